"""Objects in storage (``s3://``, ``gs://``, ``az://``) as build inputs, all in this folder:

- ``_client.py``   URLs (checked, credentials redacted), the fsspec client, ``Listing``,
                   ``ObjectStoreError``, the server's error codes
- ``_s3http.py``   the S3 client's HTTP session that never follows a redirect
- ``_calls.py``    calls to the service retried (transient failures, backoff, deadline)
- ``_pages.py``    one listing request a page, bounded (``MAX_OBJECTS``, ``MAX_PAGES``)
- ``_listing.py``  a prefix in ImageFolder layout, named objects, shard patterns -> a ``Listing``
- ``_paired.py``   a prefix of images with the prefix of their masks, paired -> a ``Listing``
- ``_fetch.py``    the spool: every object fetched once into one file, resumed, retried with backoff
- ``_objects.py``  a store from a fetched listing (one sample an object, or WebDataset shards)

The node layer (``gpucache.node._storage``) runs these once per node, in the node cache.
"""
