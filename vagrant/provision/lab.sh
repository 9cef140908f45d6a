#!/usr/bin/env bash
# Every `vagrant up` and `vagrant provision` (root): apply the chosen scenario's share for this
# VM with `nptrace lab apply-role`, from the same data as the namespace lab. It resets what an
# earlier apply left first, so switching scenarios is:
#   NPTRACE_LAB_SCENARIO=no-listener vagrant provision --provision-with lab
# In the k8s profile, the k3s server (node1) then also makes the scenario's Kubernetes side
# (vagrant/k8s/scenario.sh), once k3s is installed.
set -euo pipefail

role=${NPTRACE_ROLE:?NPTRACE_ROLE is not set (the Vagrantfile sets it)}
profile=${NPTRACE_LAB_PROFILE:-netns}
scenario=${NPTRACE_LAB_SCENARIO:-healthy}
variant=${NPTRACE_LAB_VARIANT:-}
backend=${NPTRACE_LAB_BACKEND:-iptables}
src=${NPTRACE_SRC:-/vagrant}

args=(apply-role "$scenario" --role "$role" --profile "$profile" --backend "$backend")
if [ -n "$variant" ]; then
    args+=(--variant "$variant")
fi
# The module entry point needs no `nptrace lab` registration; it is the same command.
"$src/.venv/bin/python" -m nptrace.lab.vm "${args[@]}"

if [ "$profile" = k8s ] && [ -f /etc/rancher/k3s/k3s.yaml ]; then
    bash "$src/vagrant/k8s/scenario.sh" "$scenario" "$variant"
fi
