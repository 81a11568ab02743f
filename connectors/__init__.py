"""KV offload connectors with the streaming-session fix, and a CPU tier for the CPU platform.

vLLM's engine processes import these modules by path, so nothing here imports
the app. Importing this package itself imports no vLLM code.
"""

OFFLOADING_CONNECTOR_NAME = "StreamingSafeOffloadingConnector"
OFFLOADING_CONNECTOR_MODULE = "connectors.offloading"
SIMPLE_CONNECTOR_NAME = "StreamingSafeSimpleCPUOffloadConnector"
SIMPLE_CONNECTOR_MODULE = "connectors.simple"
HOST_TIER_SPEC_NAME = "HostTierOffloadingSpec"
HOST_TIER_SPEC_MODULE = "connectors.host_tier"
DISK_TIER_SPEC_NAME = "DiskTierOffloadingSpec"
DISK_TIER_SPEC_MODULE = "connectors.disk_tier"
# kv_connector_extra_config keys of the disk tier (connectors.disk_tier).
DISK_TIER_DIR_KEY = "disk_tier_dir"
DISK_TIER_BYTES_KEY = "disk_tier_bytes"
DISK_TIER_FSYNC_KEY = "disk_tier_fsync"
DISK_TIER_WRITE_QUEUE_BYTES_KEY = "disk_tier_write_queue_bytes"
# The directory is shared by several replicas (connectors.disk_files: locks, one sweeper).
DISK_TIER_SHARED_KEY = "disk_tier_shared"
# The engine core's utility call that hands the API process each request's disk-tier
# tokens (installed by connectors.disk_tier in the engine core process).
DISK_TIER_TOKENS_UTILITY = "streamsess_disk_tier_tokens"
# The one that writes what the disk tier has queued, once no transfer is pending.
DISK_TIER_FLUSH_UTILITY = "streamsess_disk_tier_flush"
