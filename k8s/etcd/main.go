// etcd for the lab's real control plane: etcd's own server entry point, built in the same Go
// module as the Kubernetes release it serves, so the versions Kubernetes pins are the ones used.
package main

import (
	"os"

	"go.etcd.io/etcd/server/v3/etcdmain"
)

func main() {
	etcdmain.Main(os.Args)
}
