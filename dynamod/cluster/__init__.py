"""Multi-node: the node registry, cluster status, credentials, replicated etcd and NATS."""
