"""python -m clients.generate "prompt" | --prompt-file FILE [--url H:P] [--protocol grpc|http] [--max-tokens N] [sampling options]

Prints the answer as it streams in, then TTFT and tokens/s on stderr.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from clients.api import DEFAULT_URLS, Completion, GenerationError, LLMClient


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m clients.generate", description=__doc__.split("\n\n")[1])
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("prompt", nargs="?")
    # a long-context prompt (100K tokens is ~400 KB) exceeds what one command-line argument may hold
    source.add_argument("--prompt-file", type=Path, help="read the prompt from this file ('-': stdin)")
    parser.add_argument("--url", help=f"server address (default: {DEFAULT_URLS['grpc']} for gRPC, "
                                      f"{DEFAULT_URLS['http']} for HTTP)")
    parser.add_argument("--protocol", choices=("grpc", "http"), default="grpc")
    parser.add_argument("--model", default="llm")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, help="0 = greedy (the server's default)")
    parser.add_argument("--top-k", type=int)
    parser.add_argument("--top-p", type=float)
    parser.add_argument("--seed", type=int)
    parser.add_argument("--stop", action="append", help="stop string (repeatable; sent as stop_words)")
    parser.add_argument("--repetition-penalty", type=float)
    parser.add_argument("--min-tokens", type=int)
    parser.add_argument("--timeout", type=float, default=300.0,
                        help="seconds the request may take in all over gRPC, or between bytes over HTTP "
                             "(a cold 100K-token prompt prefills for minutes on a CPU)")
    args = parser.parse_args(argv)
    if not args.timeout > 0:
        parser.error(f"--timeout must be a positive number of seconds, got {args.timeout:g}")
    prompt = args.prompt
    if args.prompt_file is not None:
        try:
            prompt = sys.stdin.read() if str(args.prompt_file) == "-" else args.prompt_file.read_text()
        except (OSError, UnicodeDecodeError) as e:
            parser.error(f"--prompt-file: {e}")

    client = LLMClient(args.url, args.protocol, args.model, args.timeout)
    completion = Completion()
    try:
        for delta in client.stream(prompt, args.max_tokens, temperature=args.temperature, top_k=args.top_k,
                                   top_p=args.top_p, seed=args.seed, stop_words=args.stop,
                                   repetition_penalty=args.repetition_penalty, min_tokens=args.min_tokens):
            completion.add(delta)
            sys.stdout.write(delta.text)
            sys.stdout.flush()
    except GenerationError as e:
        print(f"\nerror: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return 130
    print()
    ttft = f"{completion.ttft * 1e3:.1f} ms" if completion.ttft is not None else "n/a (no tokens)"
    print(f"[kvforge] TTFT {ttft}, {len(completion.token_ids)} tokens in {completion.elapsed:.2f} s, "
          f"{completion.tokens_per_second:.1f} tokens/s after the first ({args.protocol}, {client.url})",
          file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
