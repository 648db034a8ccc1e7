"""The `thermocline` command: run the mesh, talk to it, mint development tokens."""

from __future__ import annotations

import argparse
import contextlib
import logging
import signal
import sys
import threading
from pathlib import Path

import grpc

from services.cli.client import (
    bearer_token,
    build_request,
    call_metadata,
    collect,
    dev_token,
    finish_name,
    local_state_dir,
    stream_generate,
)
from services.cli.loadgen.command import add_loadgen_parser
from services.cli.mesh import (
    AUDIT_KEY_NAME,
    SERVICE_TOKEN_NAME,
    Mesh,
    MeshConfig,
    Ports,
    ServiceFailed,
    parse_settings,
)
from services.cli.trace_collector import REQUEST_PATH, TraceCollector, format_trace
from services.common import env
from services.common.service_auth import ensure_token_file
from services.engine.model.registry import DEFAULT_MODEL, resolve_model
from services.gateway.tokens import ensure_dev_keys, mint_token

DEMO_QUESTION = "What is the capital of France?"
SETTING_HELP = (
    "a THERMOCLINE_* setting for every service, e.g. THERMOCLINE_ENGINE_KV_TIERS=true (repeatable); "
    "not one the mesh sets itself (ports, the services' targets, the model: --model, the token key, "
    "audit log, audit key and kvstore data: --state-dir), which is refused; the shell's own "
    "THERMOCLINE_* variables do not reach the services, only where models live does"
)


def _env_settings(args: argparse.Namespace) -> dict[str, str] | None:
    """The `--env` settings of `up` and `demo`; None, with the error printed, when one is malformed."""
    try:
        return parse_settings(args.env, "--env")
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return None


def cmd_up(args: argparse.Namespace) -> int:
    """Starts the mesh and keeps it running until Ctrl-C or SIGTERM."""
    if (settings := _env_settings(args)) is None:
        return 2
    config = MeshConfig(
        model=args.model,
        state_dir=local_state_dir(args.state_dir),
        otlp_endpoint=env.otlp_endpoint(),
        env=settings,
    )
    mesh = Mesh(config)
    resolve_model(args.model, progress=True)  # download before the mesh starts, so its progress shows here
    print(f"starting the mesh with {args.model} (logs in {mesh.logs_dir}) ...", flush=True)
    mesh.start(progress=True)
    with mesh:
        _print_endpoints(mesh)
        stop = threading.Event()
        signal.signal(signal.SIGTERM, lambda *_: stop.set())
        with contextlib.suppress(KeyboardInterrupt):
            stop.wait()
        print("\nstopping ...")
    return 0


def _print_endpoints(mesh: Mesh) -> None:
    ports = mesh.config.ports
    for service in ("gateway", "engine", "safety", "kvstore"):
        print(
            f"  {service:<8} grpc {mesh.target(service):<20} metrics http://127.0.0.1:{ports.metrics[service]}/metrics"
        )
    print(f"  gateway  http {mesh.http_url():<20} (OpenAI-compatible)")
    if "redis" in mesh.processes:
        print(f"  redis    redis://127.0.0.1:{ports.redis}/0")
    print(f'\ntry: thermocline generate --chat "{DEMO_QUESTION}"\nCtrl-C stops everything.', flush=True)


def cmd_generate(args: argparse.Namespace) -> int:
    """Streams one answer from the gateway to the terminal."""
    token = bearer_token(args.token, local_state_dir(args.state_dir), "dev-user", "dev")
    request = build_request(
        args.prompt,
        chat=args.chat,
        model=args.model,
        max_tokens=args.max_tokens,
        temperature=args.temperature,
    )
    with grpc.insecure_channel(args.target) as channel:
        try:
            result = collect(
                stream_generate(channel, request, call_metadata(token, args.intent), args.timeout), echo=True
            )
        except grpc.RpcError as error:
            print(f"error: {error.code().name}: {error.details()}", file=sys.stderr)
            return 1
    if result.done is not None:
        done = result.done
        print(
            f"[{done.model}] finish={finish_name(done.finish_reason)} "
            f"prompt_tokens={done.usage.prompt_tokens} completion_tokens={done.usage.completion_tokens} "
            f"trace_id={done.trace_id}",
            file=sys.stderr,
        )
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    """Starts the mesh, asks one chat question, and prints the answer and each hop's time."""
    if (settings := _env_settings(args)) is None:
        return 2
    collector = TraceCollector().start()
    state_dir = local_state_dir(args.state_dir)
    config = MeshConfig(
        model=args.model,
        state_dir=state_dir,
        ports=Ports.free(),
        otlp_endpoint=collector.endpoint,
        env=settings,
    )
    try:
        print(f"fetching {args.model} (the first run downloads it) ...", flush=True)
        resolve_model(args.model, progress=True)
        mesh = Mesh(config)
        mesh.start(progress=True)
        with mesh:
            print(f"mesh is up; asking: {DEMO_QUESTION}\n", flush=True)
            token = dev_token(state_dir)
            request = build_request(DEMO_QUESTION, chat=True, max_tokens=args.max_tokens)
            with grpc.insecure_channel(mesh.target("gateway")) as channel:
                result = collect(stream_generate(channel, request, call_metadata(token), 300), echo=True)
            assert result.done is not None
            trace_id = result.done.trace_id
            spans = collector.wait_for_spans(trace_id, REQUEST_PATH, timeout_s=30)
        print(f"\ntrace id {trace_id}; time at each hop:\n{format_trace(spans)}")
        return 0
    except ServiceFailed as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    finally:
        collector.stop()


def cmd_token(args: argparse.Namespace) -> int:
    """Prints a development token signed with the mesh's development key (or --key)."""
    private_path = (
        Path(args.key) if args.key else ensure_dev_keys(local_state_dir(args.state_dir) / "keys")[0]
    )
    extra: dict[str, object] = {"roles": args.role} if args.role else {}
    token = mint_token(
        private_path.read_bytes(),
        subject=args.subject,
        tenant=args.tenant,
        ttl_s=args.ttl_s,
        issuer=args.issuer,
        audience=args.audience,
        algorithm=args.algorithm,
        extra_claims=extra,
    )
    print(token)
    return 0


def _audit_key_file(args: argparse.Namespace) -> Path | None:
    """--key-file, else THERMOCLINE_GATEWAY_AUDIT_KEY_FILE, else the local mesh's key if there is one."""
    if args.key_file:
        return Path(args.key_file)
    configured = env.get_optional_str("THERMOCLINE_GATEWAY_AUDIT_KEY_FILE")
    if configured:
        return Path(configured)
    local = local_state_dir(args.state_dir) / "keys" / AUDIT_KEY_NAME
    return local if local.exists() else None


def cmd_audit_verify(args: argparse.Namespace) -> int:
    """Verifies the audit log's hash chains and signed checkpoints; exit status 1 names where trust ends."""
    from services.gateway.audit import STREAMS
    from services.gateway.audit_checkpoint import Signer, load_key
    from services.gateway.audit_verify import verify_directory

    directory = Path(args.directory or local_state_dir(args.state_dir) / "audit")
    if not directory.is_dir():
        print(f"error: {directory} is not a directory", file=sys.stderr)
        return 2
    key_file = _audit_key_file(args)
    try:
        signer = None if key_file is None else Signer(load_key(key_file))
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    if signer is None:
        print(
            "warning: no signing key (--key-file): only the hash chain is checked, and a chain "
            "rewritten from some event on would still verify",
            file=sys.stderr,
        )
    report = verify_directory(directory, STREAMS, signer)
    counts = ", ".join(f"{stream}: {n} events" for stream, n in report.num_events.items())
    if report.is_ok:
        print(f"audit log {directory} verifies ({counts})")
        return 0
    for problem in report.problems:
        print(f"TAMPERED: {problem}", file=sys.stderr)
    return 1


def cmd_keys(args: argparse.Namespace) -> int:
    """Makes the gateway's RSA key pair and the services' shared token (e.g. for compose: deploy/keys)."""
    private_path, public_path = ensure_dev_keys(Path(args.directory))
    token_path = ensure_token_file(Path(args.directory) / SERVICE_TOKEN_NAME)
    print(f"private key   {private_path}\npublic key    {public_path}\nservice token {token_path}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The command-line interface."""
    parser = argparse.ArgumentParser(prog="thermocline", description=__doc__)
    parser.add_argument("--state-dir", help="keys, logs and data of the local mesh (default ./var)")
    commands = parser.add_subparsers(dest="command", required=True)

    up = commands.add_parser("up", help="start redis and the four services on loopback")
    up.add_argument("--model", default=DEFAULT_MODEL, help="model name, HF directory or .gguf file")
    up.add_argument("--env", action="append", default=[], metavar="KEY=VALUE", help=SETTING_HELP)
    up.set_defaults(func=cmd_up)

    generate = commands.add_parser("generate", help="stream an answer from the gateway")
    generate.add_argument("prompt")
    generate.add_argument("--chat", action="store_true", help="send the prompt as one user chat turn")
    generate.add_argument("--target", default="127.0.0.1:50051")
    generate.add_argument(
        "--token", help="bearer JWT (default: $THERMOCLINE_TOKEN, else a development token)"
    )
    generate.add_argument("--model", default="")
    generate.add_argument("--intent", default=None)
    generate.add_argument("--max-tokens", type=int, default=128)
    generate.add_argument("--temperature", type=float, default=0.0)
    generate.add_argument("--timeout", type=float, default=300.0, help="deadline in seconds")
    generate.set_defaults(func=cmd_generate)

    demo = commands.add_parser("demo", help="start the mesh, ask one question, show the trace")
    demo.add_argument("--model", default=DEFAULT_MODEL)
    demo.add_argument("--max-tokens", type=int, default=64)
    demo.add_argument("--env", action="append", default=[], metavar="KEY=VALUE", help=SETTING_HELP)
    demo.set_defaults(func=cmd_demo)

    token = commands.add_parser("token", help="mint a development JWT")
    token.add_argument("--subject", default="dev-user")
    token.add_argument("--tenant", default="dev")
    token.add_argument("--ttl-s", type=float, default=3600.0)
    token.add_argument("--role", action="append", help="a role for the 'roles' claim (repeatable)")
    token.add_argument("--issuer", default="thermocline-dev")
    token.add_argument("--audience", default="thermocline")
    token.add_argument("--algorithm", default="RS256", choices=["RS256", "ES256", "HS256"])
    token.add_argument("--key", help="private PEM (or HS256 secret) to sign with (default: the dev key)")
    token.set_defaults(func=cmd_token)

    audit = commands.add_parser("audit", help="audit log tools")
    audit_commands = audit.add_subparsers(dest="audit_command", required=True)
    verify = audit_commands.add_parser("verify", help="check the hash chains of an audit directory")
    verify.add_argument("directory", nargs="?", help="default: <state dir>/audit")
    verify.add_argument(
        "--key-file",
        help="the gateway's audit signing key (default: $THERMOCLINE_GATEWAY_AUDIT_KEY_FILE, "
        "else <state dir>/keys/audit.key)",
    )
    verify.set_defaults(func=cmd_audit_verify)

    keys = commands.add_parser("keys", help="make an RSA key pair for token signing and the service token")
    keys.add_argument("directory")
    keys.set_defaults(func=cmd_keys)

    add_loadgen_parser(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `thermocline` console script."""
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(message)s")
    args = build_parser().parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
