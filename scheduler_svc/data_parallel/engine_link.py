"""One engine (data-parallel replica) as the front reaches it: its channel, its health as last polled, whether
it is lost, and the Generate calls the front has in flight on it.

Who owns what: the front (front_service.py) owns one EngineLink per engine and polls each; a Generate handler
opens an EngineCall through the link and relays it. The link only tracks the calls so that, when the engine is
declared lost, it can cancel them at once (marking each `lost`), and the handler resends or fails its request.

When an engine is lost (docs/scale_out.md, "Failures"):
- a Generate call on it ends UNAVAILABLE (its scheduler process exited: the socket closes), and the handler
  marks the link not serving until the next poll says otherwise (`mark_unreachable`);
- or its health check finds the channel UNAVAILABLE (nothing accepts the connection: the process is gone, or
  its host) at every poll for longer than ENGINE_LOST_GRACE_S: the link is `lost`, every call in flight on it
  is cancelled. Why a grace: a scheduler restarting answers NOT_SERVING (reachable, so not lost), and a
  connection that drops once and comes back must not cancel streams. A check that times out (a busy or hung
  scheduler that still holds its connection) is not counted: the engine gets no new request while it does not
  answer, but its streams are left to finish.
A lost engine gets no new request until its health says SERVING again (a restarted scheduler).
"""

from __future__ import annotations

import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from scheduler_svc.api.grpc_server import SERVICE_NAME

HEALTH_TIMEOUT_S = 1.0
ENGINE_LOST_GRACE_S = 3.0
_CHANNEL_OPTIONS = (("grpc.max_receive_message_length", -1), ("grpc.max_send_message_length", -1))
FORWARDED_UNARY = ("ModelInfo", "Tokenize", "Detokenize")


class EngineCall:
    """One Generate call the front made to an engine for a client's request: `lost` is set when the engine was
    declared lost while the call ran (the call was cancelled for that reason, not by the client)."""

    def __init__(self, call: grpc.aio.UnaryStreamCall) -> None:
        self.call = call
        self.lost = False


class EngineLink:
    """One engine's channel, raw-bytes callables of its methods, whether its health said SERVING at the last
    poll, since when its channel has been UNAVAILABLE (None while not) and the front's calls in flight on it."""

    def __init__(self, index: int, target: str, credentials: grpc.ChannelCredentials | None) -> None:
        self.index = index
        self.target = target
        self.channel = (grpc.aio.insecure_channel(target, options=_CHANNEL_OPTIONS) if credentials is None
                        else grpc.aio.secure_channel(target, credentials, options=_CHANNEL_OPTIONS))
        self._generate = self.channel.unary_stream(f"/{SERVICE_NAME}/Generate")
        self.unary = {name: self.channel.unary_unary(f"/{SERVICE_NAME}/{name}")
                      for name in (*FORWARDED_UNARY, "Abort", "GetStats")}
        self._health = health_pb2_grpc.HealthStub(self.channel)
        self.serving = False
        self.lost = False
        self.silent_since: float | None = None
        self._calls: set[EngineCall] = set()

    @property
    def name(self) -> str:
        return f"engine {self.index} ({self.target})"

    def generate(self, request: bytes, metadata, timeout: float | None) -> EngineCall:
        """A Generate call on this engine, tracked until `done`."""
        engine_call = EngineCall(self._generate(request, metadata=metadata, timeout=timeout))
        self._calls.add(engine_call)
        return engine_call

    def done(self, engine_call: EngineCall) -> None:
        engine_call.call.cancel()  # a no-op once the engine's call ended; else the engine aborts the request
        self._calls.discard(engine_call)

    def mark_unreachable(self) -> None:
        """A call found the engine gone (UNAVAILABLE): no new request until a poll says it serves."""
        self.serving = False

    async def poll_health(self, now: float | None = None) -> bool:
        try:
            reply = await self._health.Check(health_pb2.HealthCheckRequest(service=""), timeout=HEALTH_TIMEOUT_S)
        except grpc.RpcError as error:
            self.serving = False
            if error.code() == grpc.StatusCode.UNAVAILABLE:
                self._unreachable_at(time.monotonic() if now is None else now)
            else:  # no reply in time: reachable but slow or hung; its streams are left to finish
                self.silent_since = None
            return False
        self.serving = reply.status == health_pb2.HealthCheckResponse.SERVING
        self.silent_since, self.lost = None, False
        return self.serving

    def _unreachable_at(self, now: float) -> None:
        if self.silent_since is None:
            self.silent_since = now
        if not self.lost and now - self.silent_since > ENGINE_LOST_GRACE_S:
            self.lost = True
            for engine_call in list(self._calls):
                engine_call.lost = True
                engine_call.call.cancel()
