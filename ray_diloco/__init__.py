"""ray-diloco: DiLoCo training of LLMs across regions with Ray Train (FSDP2) and Hivemind."""

import os

# Hivemind switches torch to the "file_system" sharing strategy on import, which goes through the
# torch_shm_manager daemon; on a loaded node its connection times out ("Shared memory manager connection
# has timed out") and the round fails. File descriptors need no daemon; a round shares a few dozen tensors.
os.environ.setdefault("HIVEMIND_MEMORY_SHARING_STRATEGY", "file_descriptor")

__version__ = "0.1.0"
