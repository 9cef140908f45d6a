"""The lab's real tier: a real Kubernetes control plane (etcd, kube-apiserver,
kube-controller-manager) and one real kube-proxy per lab node write the rules that the
generated tier (kuberules.py, ipvsrules.py) models.

The lab writes Nodes, Services and Pods through the API, as a kubelet and a user would;
kube-controller-manager's EndpointSlice controller derives the slices; each node's kube-proxy
programs its namespace at its own pace. Pods stay network namespaces. The binaries come from
k8s/build.sh (`make k8s`): releases.py finds them.

  releases.py   the pinned releases (k8s/releases) and where their binaries are
  pki.py        the cluster's CA, serving and client certificates, ServiceAccount keys
  api.py        a small REST client (client certificate or bearer token)
  objects.py    pure: the Nodes, Services and Pods a scenario's data stands for
  controlplane.py  etcd, kube-apiserver and kube-controller-manager for one lab
  kubeproxy.py  one kube-proxy per lab node namespace
  lab.py        the real tier's part of `lab up`, its steps and `lab down`
"""
