"""The LoRA adapters the server serves now: those of --lora-modules, plus those loaded at run time
(`LoadLoraAdapter`, the gateway's /v1/load_lora_adapter), minus those unloaded.

Who owns it: the gRPC servicer (`ServedModel.loras`), on the service's event loop; Generate reads it to map a
request's `lora_name` to its adapter, ModelInfo (/v1/models) lists it. It holds names and directories only: which
adapter sits in which GPU slot is the scheduler's (scheduler_svc/core/lora_slots.py), and a request keeps the
adapter (name, path, generation) it was admitted with, so unloading one lets the requests in flight finish while
new ones get NOT_FOUND. Each runtime load of a name gets the next generation (LoraModule.generation): the
adapter's files may have changed since the last load under the same name and path, so the workers read them
again and the prefix cache shares nothing with the earlier weights.

Runtime updates only with --allow-runtime-lora-updating (vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING): an adapter is
read before it is accepted, with the refusals of the start (service_runtime/lora_modules.py), plus its weights
file's tensor names and ranks from the safetensors header.
"""

from __future__ import annotations

import grpc

from service_runtime.lora_modules import (
    LoraModule,
    ProjectionShapes,
    read_adapter_config,
    read_adapter_tensor_names,
)


class LoraRefused(Exception):
    """A LoRA call or a request's `lora_name` refused: the gRPC status and the message."""

    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code = code


class LoraRegistry:
    def __init__(self, enable_lora: bool = False, modules: tuple[LoraModule, ...] = (), max_lora_rank: int = 0,
                 allow_runtime_updating: bool = False, projection_shapes: ProjectionShapes | None = None) -> None:
        self.enable_lora = enable_lora
        self._projection_shapes = projection_shapes  # the base model's: a runtime adapter's tensors must fit
        self._max_lora_rank = max_lora_rank
        self._allow_runtime_updating = allow_runtime_updating
        self._modules: dict[str, LoraModule] = {module.name: module for module in modules}
        self._generations: dict[str, int] = {}  # runtime loads of each name so far (never reset by an unload)

    @property
    def modules(self) -> tuple[LoraModule, ...]:
        """The adapters served, in the order they were given or loaded."""
        return tuple(self._modules.values())

    def selection(self, lora_name: str) -> LoraModule | None:
        """A request's adapter (None: the base model, for an empty name). Raises LoraRefused: INVALID_ARGUMENT
        with LoRA off, NOT_FOUND for a name not served (now)."""
        if not lora_name:
            return None
        if not self.enable_lora:
            raise LoraRefused(grpc.StatusCode.INVALID_ARGUMENT,
                              f"lora_name: LoRA is not enabled on this server (--enable-lora); got {lora_name!r}")
        module = self._modules.get(lora_name)
        if module is None:
            raise LoraRefused(grpc.StatusCode.NOT_FOUND, f"lora_name: the LoRA adapter {lora_name!r} does not exist "
                              f"(served: {', '.join(self._modules) or 'none'})")
        return module

    def load(self, lora_name: str, lora_path: str) -> LoraModule:
        """Serves the adapter at `lora_path` as `lora_name` from now on, once read and accepted. Raises
        LoraRefused: FAILED_PRECONDITION without the flag (or LoRA), INVALID_ARGUMENT for a name already served,
        an empty field, or an adapter the server cannot serve (naming the key)."""
        self._check_allowed()
        if not lora_name or not lora_path:
            raise LoraRefused(grpc.StatusCode.INVALID_ARGUMENT, "lora_name and lora_path are both required")
        if lora_name in self._modules:
            raise LoraRefused(grpc.StatusCode.INVALID_ARGUMENT,
                              f"the LoRA adapter {lora_name!r} is already loaded (unload it first)")
        module = LoraModule(lora_name, lora_path)
        try:
            config = read_adapter_config(module, self._max_lora_rank)
            read_adapter_tensor_names(module, config.rank, self._projection_shapes)
        except (ValueError, OSError) as error:
            raise LoraRefused(grpc.StatusCode.INVALID_ARGUMENT, str(error)) from None
        generation = self._generations[lora_name] = self._generations.get(lora_name, 0) + 1
        module = self._modules[lora_name] = LoraModule(lora_name, lora_path, generation=generation)
        return module

    def unload(self, lora_name: str) -> None:
        """Stops serving `lora_name`: its requests in flight finish, new ones get NOT_FOUND. Raises LoraRefused:
        FAILED_PRECONDITION without the flag, NOT_FOUND for a name not served."""
        self._check_allowed()
        if self._modules.pop(lora_name, None) is None:
            raise LoraRefused(grpc.StatusCode.NOT_FOUND, f"the LoRA adapter {lora_name!r} is not loaded "
                              f"(served: {', '.join(self._modules) or 'none'})")

    def _check_allowed(self) -> None:
        if not self.enable_lora or not self._allow_runtime_updating:
            raise LoraRefused(grpc.StatusCode.FAILED_PRECONDITION,
                              "loading and unloading LoRA adapters at run time needs --enable-lora and "
                              "--allow-runtime-lora-updating (vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING)")
