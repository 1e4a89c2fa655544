"""eaglet behind an OpenAI-compatible HTTP server: any chat front end, editor plugin or agent framework that speaks
OpenAI's wire protocol can use the speculative decoder, and a greedy reply is the text generate.py prints.

    python serve.py                                              # the shipped demo on 127.0.0.1:8000
    python serve.py --checkpoint_path checkpoints/meta-llama/Llama-2-7b-chat-hf \\
        --draft_checkpoint_path checkpoints/yuhuili/EAGLE-llama2-chat-7B --compile --api_key secret

One engine thread owns the model and runs requests in arrival order from a bounded queue (full: 503 at once);
the HTTP side only parses, checks, queues and streams. A stream sends one chunk per cycle (the tokens a cycle
emits arrive together). A client that goes away stops its generation at the end of the cycle under way. The
last request's tokens stay in the cache: a request that extends them (the next turn of a chat) prefills only
its new tokens and says so in usage.prompt_tokens_details.cached_tokens. docs/serve.md has the details.

The rooms, in server/: fields.py checks each field, requests.py turns a request into the engine's Jobs, engine.py
runs them, replies.py shapes what comes back, app.py is the HTTP routes and the process; this file is the command:
its flags, then app.py's run.
"""
import generate
from cli import cli_parser, float_flag, int_flag


def parse_args(argv=None):
    p = generate.model_flags(cli_parser(__doc__))
    p.add_argument("--host", default="127.0.0.1", help="the address to listen on (0.0.0.0: every interface)")
    p.add_argument("--port", type=int_flag(0, 65535), default=8000, help="0: any free port (the ready line names it)")
    p.add_argument("--api_key", default=None, help="require 'Authorization: Bearer KEY' on /v1/ requests")
    p.add_argument("--max_queue", type=int_flag(1), default=16, help="requests waiting at most; more get 503")
    p.add_argument("--allowed_origins", default="*",
                   help="comma-separated origins whose pages may call the API (CORS; a preflight needs no key); "
                        "'' allows none")
    p.add_argument("--served_model_name", action="append", default=None,
                   help="a name requests may give as model besides the checkpoint's own id (repeatable; default: "
                        "eaglet); any other name gets 404")
    p.add_argument("--max_batch", type=int_flag(1), default=1,
                   help="greedy requests that wait together run as one batch of up to this many rows, each row "
                        "exactly its own reply (caches of this many rows)")
    p.add_argument("--shutdown_grace", type=float_flag(0, 3600), default=5.0,
                   help="on SIGTERM / SIGINT, seconds the replies in flight may run on before they are cancelled "
                        "(new requests get 503 at once; a second signal exits at once)")
    p.add_argument("--reasoning_parser", choices=("auto", "none"), default="auto",
                   help="auto: where the chat template thinks (<think> ... </think>), a chat reply's thinking goes to "
                        "reasoning_content and its answer to content, and a grammar or forced tool call starts where "
                        "the thinking ends; none: the reply as it comes, every grammar from its first token")
    args = p.parse_args(argv)
    generate.check_model_flags(p, args)
    return args


def main(argv=None):
    args = parse_args(argv)
    from server.app import run  # FastAPI, uvicorn and the server's rooms once the flags are known good
    run(args)


if __name__ == "__main__":
    main()
