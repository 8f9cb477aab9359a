#!/bin/sh
# The image's entry point: `pagedserve ARGS`, except that a service bound to every interface needs an API key.
#
# Why here: with host networking (the compose files) or a published port, a server bound to 0.0.0.0 or :: is
# open to the network, and the image's users did not all mean that. A bind to every interface (--host,
# --grpc-host or --http-host given 0.0.0.0, ::, [::] or an empty value) starts only with a key: --api-key
# VALUE on the command line, or $PAGEDSERVE_API_KEY or $VLLM_API_KEY in the environment (which the services
# read themselves, off the command line). Loopback binds (every service's default) start as they are.
set -eu

wildcard=""
has_key=""
previous=""
is_wildcard() { case "$1" in 0.0.0.0 | :: | "[::]" | "") return 0 ;; *) return 1 ;; esac; }
for arg in "$@"; do
  case "$previous" in
    --host | --grpc-host | --http-host) if is_wildcard "$arg"; then wildcard="$previous $arg"; fi ;;
    --api-key) if [ -n "$arg" ]; then has_key=1; fi ;;
  esac
  case "$arg" in
    --host=* | --grpc-host=* | --http-host=*) if is_wildcard "${arg#*=}"; then wildcard="$arg"; fi ;;
    --api-key=?*) has_key=1 ;;
  esac
  previous="$arg"
done

if [ -n "$wildcard" ] && [ -z "$has_key" ] && [ -z "${PAGEDSERVE_API_KEY:-}${VLLM_API_KEY:-}" ]; then
  echo "pagedserve: refusing to serve on every interface ($wildcard) without an API key: set PAGEDSERVE_API_KEY (or VLLM_API_KEY), or bind 127.0.0.1" >&2
  exit 2
fi
exec pagedserve "$@"
