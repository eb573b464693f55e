"""Rule-based reward server for tiny-grpo, standing in for a remote reward model.

    python3 -m rlhf_tasks.demo.reward_server [--host 127.0.0.1] [--port 23080]

API (JSON in, JSON out; every other method answers 405, so health checks must POST,
as with a real reward model server):

    POST /score       {"prompts": ["3+4=", ...], "completions": ["7", ...]}
                      -> {"rewards": [1.0, ...]}
    POST /get_reward  {"query": ["3+4=7", ...], "prompts": ["3+4=", ...]}
                      -> {"rewards": [1.0, ...]}
        OpenRLHF's remote reward model API: each query is prompt + completion.

A prompt is integer arithmetic "a+b=", "a-b=" or "a*b=". A completion scores 1.0 if it
is exactly the answer, 0.5 if its first number is the answer but it has extra text
(e.g. " 7." or "07"), otherwise 0.0; so does any prompt that is not such arithmetic.
Malformed requests answer 400 with {"error": ...}. Standard library only, so it starts
anywhere in milliseconds; one access log line per request goes to stderr.
"""

from __future__ import annotations

import argparse
import json
import operator
import re
import signal
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

MAX_BODY_BYTES = 16 * 1024 * 1024
PROMPT_RE = re.compile(r"^\s*(-?\d+)\s*([-+*])\s*(-?\d+)\s*=\s*$")
NUMBER_RE = re.compile(r"-?\d+")
OPERATORS = {"+": operator.add, "-": operator.sub, "*": operator.mul}


class BadRequest(Exception):
    """The request body is not what the route expects (answered with 400)."""


def expected_answer(prompt: str) -> int | None:
    """The answer to an arithmetic prompt, or None if the prompt is not one."""
    match = PROMPT_RE.match(prompt)
    if match is None:
        return None
    left, op, right = match.groups()
    return OPERATORS[op](int(left), int(right))


def score(prompt: str, completion: str) -> float:
    """Reward in [0, 1]: 1 for the exact answer, 0.5 for the answer with extra text."""
    answer = expected_answer(prompt)
    if answer is None:
        return 0.0
    if completion.strip() == str(answer):
        return 1.0
    first_number = NUMBER_RE.search(completion)
    if first_number is not None and int(first_number.group()) == answer:
        return 0.5
    return 0.0


def _string_list(body: dict, key: str) -> list[str]:
    value = body.get(key)
    if not isinstance(value, list) or not all(isinstance(item, str) for item in value):
        raise BadRequest(f'"{key}" must be a list of strings')
    return value


def _same_length(a: list[str], a_key: str, b: list[str], b_key: str) -> None:
    if len(a) != len(b):
        raise BadRequest(f'"{a_key}" has {len(a)} items but "{b_key}" has {len(b)}')


def rewards_for_score(body: dict) -> list[float]:
    prompts = _string_list(body, "prompts")
    completions = _string_list(body, "completions")
    _same_length(prompts, "prompts", completions, "completions")
    return [score(p, c) for p, c in zip(prompts, completions)]


def rewards_for_get_reward(body: dict) -> list[float]:
    """OpenRLHF style: split each query into prompt and completion by the given prompt."""
    queries = _string_list(body, "query")
    prompts = _string_list(body, "prompts")
    _same_length(queries, "query", prompts, "prompts")
    return [score(p, q[len(p):]) if q.startswith(p) else 0.0 for q, p in zip(queries, prompts)]


ROUTES = {"/score": rewards_for_score, "/get_reward": rewards_for_get_reward}


class RewardHandler(BaseHTTPRequestHandler):
    server_version = "tiny-grpo-reward/1"

    def do_POST(self) -> None:
        route = ROUTES.get(self.path.split("?", 1)[0])
        if route is None:
            self._reply(404, {"error": f"no route {self.path}; POST /score or /get_reward"})
            return
        try:
            rewards = route(self._read_json())
        except BadRequest as exc:
            self._reply(400, {"error": str(exc)})
            return
        self._reply(200, {"rewards": rewards})

    def _method_not_allowed(self) -> None:
        self._reply(405, {"error": f"{self.command} not allowed; POST /score or /get_reward"}, {"Allow": "POST"})

    do_GET = do_HEAD = do_PUT = do_DELETE = do_PATCH = do_OPTIONS = _method_not_allowed

    def _read_json(self) -> dict:
        try:
            length = int(self.headers.get("Content-Length", ""))
        except ValueError:
            raise BadRequest("a JSON body with Content-Length is required") from None
        if not 0 <= length <= MAX_BODY_BYTES:
            raise BadRequest(f"body must be at most {MAX_BODY_BYTES} bytes")
        raw = self.rfile.read(length)
        try:
            body = json.loads(raw)
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise BadRequest(f"bad JSON: {exc}") from None
        if not isinstance(body, dict):
            raise BadRequest("the JSON body must be an object")
        return body

    def _reply(self, status: int, payload: dict, headers: dict[str, str] | None = None) -> None:
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)

    def log_message(self, format: str, *args) -> None:
        sys.stderr.write(f"reward_server {self.address_string()} {format % args}\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python3 -m rlhf_tasks.demo.reward_server", description=__doc__.split("\n\n")[0])
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=23080, help="port to listen on, 0 for any free one (default 23080)")
    args = parser.parse_args(argv)

    server = ThreadingHTTPServer((args.host, args.port), RewardHandler)
    server.daemon_threads = True

    def stop(signum, frame) -> None:
        # shutdown() waits for serve_forever() to return, so it must not run on this thread.
        threading.Thread(target=server.shutdown, daemon=True).start()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    host, port = server.server_address[:2]
    print(f"reward server listening on http://{host}:{port} (POST /score, /get_reward)", flush=True)
    try:
        server.serve_forever()
    finally:
        server.server_close()
    print("reward server stopped", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
