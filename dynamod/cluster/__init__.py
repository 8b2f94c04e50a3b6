"""Multi-node: one dynamod per node coordinated through the stack's etcd. The registry of
nodes and their units, node loss and return, the cluster-wide stop. A feature layer beside
rollout/ (it may import core/ and rollout/); control/ composes it; core/ never imports it."""
