#!/usr/bin/env bash
# The Kubernetes side of a lab scenario, on the k3s cluster of the k8s profile (run as root on
# the k3s server VM, node1; vagrant/provision/lab.sh calls it after apply-role):
#   bash /vagrant/vagrant/k8s/scenario.sh SCENARIO [VARIANT]
# It re-creates the seed's web Deployment and Service (web.yaml), then makes the scenario's
# fault with real objects, so that the real kube-proxy (iptables, nftables or IPVS mode)
# writes the rules the namespace lab emulates. The host side of every scenario (addresses,
# routes, sysctls, the firewall on mbox) comes from `nptrace lab apply-role` on each VM.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
export KUBECONFIG=${KUBECONFIG:-/etc/rancher/k3s/k3s.yaml}

# Faults a live kube-proxy does not hold still: it re-adds a flushed POSTROUTING jump at its
# next sync, and removes a deleted pod's endpoint as soon as the EndpointSlice changes. The
# rollout scenarios change the cluster between the two halves of the trigger (held
# connections): the namespace lab's runner does that in its steps; vm-trigger has no steps.
# conntrack-table-full fills node1's table to a limit of 256: on a cluster, the node's own
# connections (k3s, flannel, coredns) hold entries too, and kube-proxy owns nf_conntrack_max.
UNSUPPORTED="missing-snat stale-endpoint rollout-in-flight container-restart conntrack-table-full ipvs-no-endpoints ipvs-etp-local-no-endpoint ipvs-missing-snat ipvs-stale-endpoint"

name=${1:?usage: scenario.sh SCENARIO [VARIANT]}
variant=${2:-}
die() { echo "nptrace-lab k8s: $*" >&2; exit 2; }
log() { echo "nptrace-lab k8s: $*" >&2; }

for u in $UNSUPPORTED; do
    if [ "$name" = "$u" ]; then
        die "scenario $name needs the namespace lab's frozen kube-proxy; use NPTRACE_LAB_PROFILE=netns"
    fi
done

# The pods' server: PORT:MODE as nptrace/lab/server.py takes it; the readiness probe checks
# PROBE_PORT (what the app really listens on, unless a scenario breaks readiness).
serve() {
    local listen=$1 probe_port=$2
    kubectl patch deployment web --type=json -p "[
      {\"op\": \"replace\", \"path\": \"/spec/template/spec/containers/0/args\", \"value\": [\"--listen\", \"$listen\"]},
      {\"op\": \"replace\", \"path\": \"/spec/template/spec/containers/0/readinessProbe/tcpSocket/port\", \"value\": $probe_port}]"
}

# Run the service's pods on one node only, COUNT of them.
pin() {
    local node=$1 count=$2
    kubectl patch deployment web -p "{\"spec\": {\"replicas\": $count, \"template\": {\"spec\": {
      \"nodeSelector\": {\"kubernetes.io/hostname\": \"$node\"}, \"topologySpreadConstraints\": null}}}}"
}

local_policy() {   # externalTrafficPolicy Local; a healthCheckNodePort needs type LoadBalancer
    local hc=${1:-}
    if [ -n "$hc" ]; then
        kubectl patch service web -p "{\"spec\": {\"type\": \"LoadBalancer\", \"externalTrafficPolicy\": \"Local\",
          \"healthCheckNodePort\": $hc}}"
    else
        kubectl patch service web -p '{"spec": {"externalTrafficPolicy": "Local"}}'
    fi
}

unsupported_variant() {
    die "scenario $name variant $variant is not made on a real cluster ($1); use NPTRACE_LAB_PROFILE=netns"
}

log "scenario $name${variant:+ variant $variant}: re-creating default/web"
kubectl -n default delete networkpolicy web-ingress --ignore-not-found
kubectl delete -f "$here/web-local.yaml" --ignore-not-found
kubectl delete -f "$here/web.yaml" --ignore-not-found --wait=true
kubectl apply -f "$here/web.yaml"

wait_ready=yes
case "$name" in
    healthy)
        kubectl apply -f "$here/web-local.yaml"
        ;;
    etp-local-no-endpoint)
        # node1 has no local endpoint: kube-proxy drops (iptables/nft) NodePort traffic there.
        [ -z "$variant" ] || unsupported_variant "kube-proxy answers with DROP, never REJECT"
        local_policy 32080
        pin node2 2
        ;;
    no-endpoints)
        # Every pod fails readiness: the EndpointSlice lists them not ready, kube-proxy REJECTs.
        serve 8080:echo 9
        wait_ready=no
        ;;
    rp-filter-asymmetric)
        # Host side only (node1 strict rp_filter, from apply-role).
        [ "$variant" != underlay ] || unsupported_variant "flannel picks its own VXLAN source address"
        ;;
    wrong-interface)
        ;;  # host side only: node1's return route and mbox's stateful firewall
    offload-checksum)
        # host side only: the client's TX checksum offload off and mbox's rewrite
        [ "$variant" != overlay ] || unsupported_variant "flannel owns flannel.1 and its UDP checksums"
        ;;
    networkpolicy-drop)
        kubectl apply -f "$here/networkpolicy.yaml"
        ;;
    no-listener)
        # targetPort stays 8080; the application listens on 8081 (and its probe checks 8081).
        serve 8081:echo 8081
        ;;
    conntrack-invalid)
        # eTP=Local keeps the client address; one pod on node1 answers after 2 s, past the
        # 1 s conntrack timeout apply-role set on node1. Only iptables mode drops INVALID
        # packets (KUBE-FORWARD); nftables mode has no such rule since kubernetes PR #122663.
        local_policy
        pin node1 1
        serve 8080:delay:2 8080
        ;;
    app-reset)
        serve 8080:reset 8080
        ;;
    *)
        die "unknown scenario '$name' (nptrace lab list shows them)"
        ;;
esac

if [ "$(kubectl get nodes --no-headers 2>/dev/null | wc -l)" -lt 2 ]; then
    log "only one node has joined yet: the other pods wait for node2 (vagrant up node2)"
elif [ "$wait_ready" = yes ]; then
    if ! kubectl rollout status deployment/web --timeout=180s; then
        log "web is not ready yet (pods wait for node2 to join, or for their image); see: kubectl get pods -o wide"
    fi
fi
kubectl get pods -o wide -l app=web
kubectl get service web -o wide
