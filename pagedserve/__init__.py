"""pagedserve's top floor: the `pagedserve` command (cli.py, launcher.py), the offline `LLM` that starts a
private server (llm.py), and `pagedserve.testing`, the harness for scripting a local server in tests and
benchmarks.

Every arrow runs down from here: this package imports the services (scheduler_svc, worker_svc, gateway), the
SDK (client) and the bottom floor (service_runtime); nothing below imports it (tests/test_import_layers.py).

    from pagedserve import LLM, SamplingParams   # as `from vllm import LLM, SamplingParams`
    from pagedserve import BeamSearchParams      # as `from vllm.sampling_params import BeamSearchParams`
    from pagedserve import StructuredOutputsParams  # as `from vllm.sampling_params import StructuredOutputsParams`
    from pagedserve import LoRARequest           # as `from vllm.lora.request import LoRARequest`
"""

from client.sampling_params import SamplingParams
from client.structured_outputs import StructuredOutputsParams
from pagedserve.beam_search import BeamSearchParams
from pagedserve.llm import LLM
from pagedserve.lora_request import LoRARequest

__all__ = ["LLM", "SamplingParams", "BeamSearchParams", "StructuredOutputsParams", "LoRARequest"]
