"""Coordination on a service (etcd): membership, liveness and the checkpoint catalogue.

``EtcdSession`` is one connection to an etcd cluster; ``EtcdMembership`` registers this
node under a lease and watches the others; ``EtcdCatalogue`` keeps checkpoint records.
The node takes them through ``Node.open(config, membership=..., catalogue=...)``;
``etcd_membership.open_etcd`` builds the pair from ``Config.coordinator``;
``target.parse_etcd_url`` reads that URL (and needs no etcd client installed).
"""
