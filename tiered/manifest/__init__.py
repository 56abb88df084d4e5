"""What makes a write durable and verifiable: the store's files on disk.

``records`` (a record's fields and its checksummed SQLite row), ``database`` (the SQLite manifest
that holds them), ``meta`` (the store's id and swap-file layout), ``commits`` (group commit: data
flushed before the records naming it), ``extents`` (byte ranges and their allocator) and
``ownership`` (locked store directories, and opening the files in them safely).

Nothing is re-exported here, so that the backends and the store below which these modules sit can
import one of them without loading the rest.
"""
