"""What the node knows: interface and namespace names, netfilter rules, nf trace, node checks."""
