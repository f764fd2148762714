#!/usr/bin/env python3
"""Instructions per request from callgrind dumps of Envoy's worker threads.

    scripts/callgrind-per-request.py REQUESTS FILE...

FILEs are `--separate-threads=yes` dumps (scripts/envoy-instructions.sh writes them) covering
the same window in which Envoy served REQUESTS requests. Prints instructions per request by
object (Envoy, its remapped text `???`, libc, the kvroute module), then the kvroute module's
hooks with what they call (Envoy's callbacks included), then its costliest functions.
Instruction counts do not drift with the machine's load the way CPU time does, so two runs of
one build agree to within about 1 %.
"""
import collections
import re
import sys

COMPRESSED = re.compile(r"\((\d+)\)(?: (.*))?")


def parse(path, own, inclusive):
    """Adds `path`'s exclusive costs per (object, function) to `own`, and each function's
    cost with its calls to `inclusive`."""
    names = {"ob": {}, "fn": {}}
    ob = fn = None
    after_call = False

    def name(kind, text):
        m = COMPRESSED.match(text)
        if not m:
            return text
        if m.group(2) is not None:
            names[kind][m.group(1)] = m.group(2)
        return names[kind].get(m.group(1), "?")

    with open(path) as f:
        for line in f:
            line = line.rstrip("\n")
            if line.startswith("ob="):
                ob = name("ob", line[3:]).rsplit("/", 1)[-1]
            elif line.startswith("fn="):
                fn = name("fn", line[3:])
            elif line.startswith("cob="):
                name("ob", line[4:])
            elif line.startswith("cfn="):
                name("fn", line[4:])
            elif line.startswith("calls="):
                after_call = True
            elif line[:1].isdigit() or line[:1] in "+-*":
                parts = line.split()
                if len(parts) < 2:
                    continue
                cost = int(parts[1])
                inclusive[fn] += cost
                if after_call:
                    after_call = False
                else:
                    own[(ob, fn)] += cost


def main():
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    requests = int(sys.argv[1])
    if requests <= 0:
        sys.exit("no request was served in the window")
    own = collections.Counter()
    inclusive = collections.Counter()
    for path in sys.argv[2:]:
        parse(path, own, inclusive)
    per_object = collections.Counter()
    for (ob, _), cost in own.items():
        per_object[ob] += cost
    print(f"{sum(per_object.values()) // requests:>9,} instructions a request over {requests} requests")
    for ob, cost in per_object.most_common(6):
        print(f"{cost // requests:>9,}  {ob}")
    hooks = [(fn, c) for fn, c in inclusive.items() if fn and fn.startswith("envoy_dynamic_module_on_http")]
    if hooks:
        print("kvroute module hooks, with what they call:")
        for fn, cost in sorted(hooks, key=lambda h: -h[1]):
            print(f"{cost // requests:>9,}  {fn}")
        print("kvroute module functions (own cost):")
        module = [(fn, c) for (ob, fn), c in own.items() if ob and "kvroute" in ob]
        for fn, cost in sorted(module, key=lambda m: -m[1])[:15]:
            print(f"{cost // requests:>9,}  {fn}")


if __name__ == "__main__":
    main()
