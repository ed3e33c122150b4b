"""``hsd keys``: CURVE key pairs for the dispatcher and the workers, and the config that uses them."""

from __future__ import annotations


def cmd_keys(args) -> int:
    from common.wire.curve import generate_keys
    names = ["dispatcher"] + ([n for n in args.name if n != "dispatcher"] or ["worker"])
    written = generate_keys(args.out, names)
    for name, (public, secret) in written.items():
        print(f"{name:<12} public {public}  secret {secret}")
    server_public, server_secret = written["dispatcher"]
    clients = [str(p) for n, (p, _) in written.items() if n != "dispatcher"]
    print("\nconfig (each worker sets curve.client_secret_key to its own .key_secret file):")
    print(f"curve:\n  server_public_key: {server_public}\n  server_secret_key: {server_secret}\n"
          f"  allowed_client_keys: [{', '.join(clients)}]\n  client_secret_key: {written[names[1]][1]}")
    return 0


def add_keys_parser(sub) -> None:
    p = sub.add_parser("keys", help="make CURVE key pairs for a control plane over TCP between nodes")
    p.add_argument("--out", required=True, help="directory for the key files (NAME.key, NAME.key_secret)")
    p.add_argument("--name", action="append", default=[], metavar="NAME",
                   help="a worker (or node) key pair to make besides the dispatcher's; repeat for more (default: worker)")
    p.set_defaults(func=cmd_keys)
