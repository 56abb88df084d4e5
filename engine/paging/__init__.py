"""The paging core: parameter shards in the store, the hooks that fetch and release them around each
use, the recorded schedule that prefetches them, and the collectives that shard them across ranks."""
