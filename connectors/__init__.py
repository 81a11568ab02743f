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
