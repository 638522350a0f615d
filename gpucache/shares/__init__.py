"""Node shares (``shard="node"``): each node's store holds a random share of the data, one module
a layer (``tests/test_layers.py``):

- ``_partition.py``  which samples each node holds, a pure function of the listing (base layer)
- ``_record.py``     a share's record in the store's optional sections (store layer)
- ``_select.py``     the build side: pick the share, check its budget, reuse earlier stores
                     (ingest layer)
- ``_tar.py``        a share of WebDataset shards in storage, a window at a time (ingest layer)
- ``_order.py``      the epoch order over node-sharded stores, resumed at any node count (loader
                     layer)
"""
