#!/usr/bin/env bash
# Profile k8s, node VMs (root, once, after setup.sh and lab.sh gave the NICs their addresses):
# install k3s with kube-proxy in iptables, nftables or IPVS mode. The first node is the server
# (and a worker), the others join it as agents. Pod and Service ranges come from the lab's
# topology (via vagrant/plan.json), so node1 gets 10.244.0.0/24 and node2 10.244.1.0/24 as
# in the namespace lab, and flannel's VXLAN (VNI 1, port 8472, flannel.1) rides the lab's
# underlay NIC (ul0).
#
# Downloads: the k3s install script from get.k3s.io, which fetches the k3s binary from
# GitHub, and the pods' image (docker.io/library/python) later: the VMs need internet,
# through Vagrant's management NIC (apply-role keeps its default route).
set -euo pipefail
log() { echo "nptrace-lab k8s: $*" >&2; }

role=${NPTRACE_ROLE:?}
k3s_role=${NPTRACE_K3S_ROLE:?server or agent}
node_ip=${NPTRACE_NODE_IP:?}
server_ip=${NPTRACE_K3S_SERVER:?}
overlay_nic=${NPTRACE_OVERLAY_NIC:?the lab NIC flannel rides on}
: "${K3S_TOKEN:?}"
mode=${NPTRACE_KUBE_PROXY_MODE:-iptables}
src=${NPTRACE_SRC:-/vagrant}

case $mode in
    iptables | nftables | ipvs) ;;
    *) echo "nptrace-lab k8s: NPTRACE_KUBE_PROXY_MODE must be iptables, nftables or ipvs, not '$mode'" >&2; exit 2 ;;
esac

export DEBIAN_FRONTEND=noninteractive
pkgs=(curl ca-certificates)
if [ "$mode" = ipvs ]; then
    # kube-proxy's IPVS mode programs ip_vs over netlink and keeps its sets with ipset;
    # ipvsadm is for looking at what it did (ipvsadm -Ln).
    pkgs+=(ipset ipvsadm)
    printf '%s\n' ip_vs ip_vs_rr ip_vs_wrr ip_vs_sh nf_conntrack >/etc/modules-load.d/nptrace-ipvs.conf
    for mod in ip_vs ip_vs_rr ip_vs_wrr ip_vs_sh nf_conntrack; do
        modprobe "$mod"
    done
fi
apt-get update -qq
apt-get install -y -qq --no-install-recommends "${pkgs[@]}" >/dev/null

flannel_iface=$("$src/.venv/bin/python" -m nptrace.lab.vm vm-nics --role "$role" --lab "$overlay_nic")
# nftables mode is beta (on by default) from Kubernetes 1.31; older k3s releases need
# --kube-proxy-arg feature-gates=NFTablesProxyMode=true as well.
args=(--node-name "$role" --node-ip "$node_ip" --flannel-iface "$flannel_iface"
      --kube-proxy-arg "proxy-mode=$mode")
if [ "$k3s_role" = server ]; then
    args=(server "${args[@]}" --cluster-cidr "${NPTRACE_CLUSTER_CIDR:?}" --service-cidr "${NPTRACE_SERVICE_CIDR:?}"
          --disable traefik --disable servicelb --disable metrics-server --disable local-storage
          --write-kubeconfig-mode 0644)
else
    args=(agent "${args[@]}")
    export K3S_URL="https://$server_ip:6443"
fi
export K3S_TOKEN
if [ -n "${NPTRACE_K3S_VERSION:-}" ]; then
    export INSTALL_K3S_VERSION=$NPTRACE_K3S_VERSION
fi

log "installing k3s $k3s_role on $role ($node_ip, flannel over $flannel_iface, kube-proxy $mode)"
curl -sfL https://get.k3s.io -o /tmp/k3s-install.sh
sh /tmp/k3s-install.sh "${args[@]}"

if [ "$k3s_role" = server ]; then
    export KUBECONFIG=/etc/rancher/k3s/k3s.yaml
    for _ in $(seq 60); do
        kubectl get node "$role" >/dev/null 2>&1 && break
        sleep 2
    done
    kubectl wait --for=condition=Ready "node/$role" --timeout=180s
    bash "$src/vagrant/k8s/scenario.sh" "${NPTRACE_LAB_SCENARIO:-healthy}" "${NPTRACE_LAB_VARIANT:-}"
fi
