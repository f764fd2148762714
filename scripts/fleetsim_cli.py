"""Command-line arguments the fleet-sim comparison scripts share (`fanout-compare.py`,
`stress-compare.py`, `conversation-compare.py`): `[seeds] [--router-config JSON]`."""


def seeds_and_router_config(argv, default_seeds):
    """The comma-separated seeds (`default_seeds` when none are given) and the kvroute router
    settings passed through to `fleet-sim compare --router-config` (None: the defaults)."""
    args = list(argv)
    router_config = None
    if "--router-config" in args:
        at = args.index("--router-config")
        router_config = args[at + 1]
        del args[at:at + 2]
    seeds = [int(s) for s in (args[0] if args else default_seeds).split(",")]
    return seeds, router_config
