"""What runs on the GPU hosts: the extraction worker, the host agent and the process runner.

Needs torch, transformers and safetensors for extraction; the agent, the runner and worker/protocol/ use
the standard library only (pynvml when present). Nothing here imports `fleet`.
"""

__version__ = "0.1.0"
