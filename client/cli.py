"""The command line of the SDK: stream one generation to stdout.

stdout gets the generated text only, as it arrives (so it pipes cleanly); stderr gets the finish reason and
token counts, or one line saying what went wrong. Exit status: 0 done, 1 the server or the connection
failed, 2 the request was invalid (bad flags, or refused by the server as INVALID_ARGUMENT), 130 Ctrl-C.

The plain numeric sampling flags (--temperature T, --top-p P, ...) are made from the table of sampling fields
(protos/pagedserve/v1/sampling_fields.py): a row with a `cli_metavar` gets its flag, type and help from there.
Lists, switches and constraints have their own flags below.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Generator, Sequence

from client.errors import InvalidRequestError, PagedServeError
from client.sync_client import Client
from client.types import GenerateChunk
from protos.pagedserve.v1.sampling_fields import SAMPLING_FIELDS

EXIT_FAILED = 1
EXIT_INVALID_REQUEST = 2
EXIT_INTERRUPTED = 130


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    prompt = {"messages": [{"role": "user", "content": args.prompt}]} if args.chat else {"prompt": args.prompt}
    try:
        structured_outputs = _structured_outputs(args)
    except OSError as error:
        return _fail(f"--json-schema: {error}", EXIT_INVALID_REQUEST)
    sampling = sampling_keywords(args, structured_outputs)
    with Client(args.target, api_key=args.api_key, root_certificates=args.tls_root_cert) as client:
        try:
            if args.wait is not None:
                client.wait_ready(timeout=args.wait)
            show_logprobs = args.logprobs is not None or args.prompt_logprobs is not None
            return _print_stream(client.generate_stream(**prompt, **sampling), show_logprobs=show_logprobs)
        except (InvalidRequestError, TypeError, ValueError) as error:
            return _fail(f"invalid request: {_first_line(error)}", EXIT_INVALID_REQUEST)
        except PagedServeError as error:
            hint = " (is the server up? --wait SECONDS waits for it)" if error.code.name == "UNAVAILABLE" else ""
            return _fail(f"server at {args.target} failed: {_first_line(error)}{hint}", EXIT_FAILED)
        except TimeoutError as error:
            return _fail(str(error), EXIT_FAILED)
        except KeyboardInterrupt:
            return _fail("interrupted", EXIT_INTERRUPTED)
        except BrokenPipeError:
            # The reader went away (`| head`): stop quietly, and keep Python from failing again at exit.
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            return EXIT_FAILED


def sampling_keywords(args: argparse.Namespace, structured_outputs: dict | None = None) -> dict:
    """The SDK's sampling keywords of the parsed flags (unset flags as None: the server's defaults)."""
    return {
        **{row.name: getattr(args, row.name) for row in SAMPLING_FIELDS if row.cli_metavar},
        "stop": args.stop,
        "logit_bias": dict(args.logit_bias) if args.logit_bias else None,
        "bad_words": args.bad_words,
        "stop_token_ids": args.stop_token_ids,
        "ignore_eos": args.ignore_eos or None,
        "include_stop_str_in_output": args.include_stop_str_in_output or None,
        "skip_special_tokens": False if args.keep_special_tokens else None,
        "spaces_between_special_tokens": False if args.no_spaces_between_special_tokens else None,
        "structured_outputs": structured_outputs,
    }


def _print_stream(stream: Generator[GenerateChunk, None, None], show_logprobs: bool = False) -> int:
    """Writes each text delta as it arrives; the final newline and the summary come after the last chunk.
    If the stream fails half way, the text so far is ended with a newline before the error propagates.
    With `show_logprobs`, each token's logprobs go to stderr, one line per token."""
    last: GenerateChunk | None = None
    wrote_text = False
    try:
        for chunk in stream:
            if chunk.text:
                sys.stdout.write(chunk.text)
                sys.stdout.flush()
                wrote_text = True
            if show_logprobs:
                for kind, entries in (("prompt", chunk.prompt_logprobs), ("token", chunk.token_logprobs)):
                    for entry in entries:
                        top = " ".join(f"{t.decoded_token!r}:{t.logprob:.4f}" for t in entry.top)
                        print(f"{kind} {entry.token.decoded_token!r} logprob={entry.token.logprob:.4f} "
                              f"rank={entry.token.rank} top=[{top}]", file=sys.stderr)
            last = chunk
    except BaseException:
        if wrote_text:
            sys.stdout.write("\n")
        raise
    finally:
        stream.close()
    sys.stdout.write("\n")
    sys.stdout.flush()
    if last is not None and last.finish_reason is not None:
        print(
            f"finish_reason={last.finish_reason} prompt_tokens={last.prompt_tokens} "
            f"completion_tokens={last.completion_tokens}",
            file=sys.stderr,
        )
    else:
        print("the server ended the stream without a finish reason", file=sys.stderr)
    return 0


def _structured_outputs(args: argparse.Namespace) -> dict | None:
    """--json-schema FILE, --regex or --choice as the structured_outputs keyword (at most one: argparse's group)."""
    if args.json_schema is not None:
        with open(args.json_schema, encoding="utf-8") as schema:
            return {"json": schema.read()}
    if args.regex is not None:
        return {"regex": args.regex}
    if args.choice is not None:
        return {"choice": args.choice}
    return None


def _token_bias(text: str) -> tuple[int, float]:
    token_id, _, bias = text.partition("=")
    try:
        return int(token_id), float(bias)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected ID=BIAS, got {text!r}") from None


def _fail(message: str, status: int) -> int:
    print(f"error: {message}", file=sys.stderr)
    return status


def _first_line(error: BaseException) -> str:
    lines = str(error).strip().splitlines()
    return lines[0] if lines else type(error).__name__


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m client",
        description="Stream a generation from a pagedserve server: text to stdout, finish reason and token "
        "counts to stderr (and, with --logprobs or --prompt-logprobs, the logprobs). Unset sampling flags take "
        "the server's defaults (vLLM's).",
    )
    parser.add_argument("prompt", help="the prompt text (with --chat: the user's message)")
    parser.add_argument("--target", default="127.0.0.1:50051", help="server address (default: %(default)s)")
    parser.add_argument("--api-key", default=None, help="the server's API key (sent as a bearer token)")
    parser.add_argument("--tls-root-cert", default=None, metavar="PEM",
                        help="connect over TLS, trusting this certificate")
    parser.add_argument("--chat", action="store_true", help="send the prompt as one user message of a chat")
    for row in SAMPLING_FIELDS:
        if row.cli_metavar:
            parser.add_argument(row.cli_flag, type=row.python_type, metavar=row.cli_metavar, help=row.help)
    parser.add_argument(
        "--stop", nargs="+", action="extend", metavar="STR", help="stop strings (put the prompt before them)"
    )
    parser.add_argument("--logit-bias", nargs="+", action="extend", type=_token_bias, metavar="ID=BIAS",
                        help="add BIAS to token ID's logit")
    parser.add_argument("--bad-words", nargs="+", action="extend", metavar="WORD", help="words never generated")
    parser.add_argument("--stop-token-ids", nargs="+", action="extend", type=int, metavar="ID")
    parser.add_argument("--ignore-eos", action="store_true")
    parser.add_argument("--include-stop-str-in-output", action="store_true")
    parser.add_argument("--keep-special-tokens", action="store_true", help="skip_special_tokens=False")
    parser.add_argument("--no-spaces-between-special-tokens", action="store_true")
    constraint = parser.add_mutually_exclusive_group()
    constraint.add_argument("--json-schema", metavar="FILE", help="the output follows this JSON schema")
    constraint.add_argument("--regex", metavar="PATTERN", help="the output matches this regular expression")
    constraint.add_argument("--choice", nargs="+", metavar="STR", help="the output is one of these strings")
    parser.add_argument(
        "--wait", type=float, metavar="SECONDS", help="first wait up to SECONDS for the server to be ready"
    )
    return parser
