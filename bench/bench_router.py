"""Routing a large corpus in bounded memory: `router.shards.shard_corpus` on ~N MB of generated text.

The text is the built-in local corpus's train split repeated (each copy gets new document ids and a copy
number appended, so no two documents are identical) until the train file reaches `--mb` megabytes. The
sharding then runs in a child process, so its peak RSS (ru_maxrss of the child) is the router's alone.
Reported: input MB, documents, seconds, MB/s and peak RSS. Memory should stay flat as `--mb` grows: pass 1
keeps only each document's prefix, size and domain; the router is fitted on at most `--fit-sample` documents;
pass 2 streams the tokens into the shard files.

    .venv/bin/python bench/bench_router.py [--mb 1000] [--paths 4] [--levels 2,2] [--workdir DIR] [--keep]
"""

from __future__ import annotations

import argparse
import json
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from router.corpus import MANIFEST_FILE, TRAIN_FILE, build_local_corpus, iter_jsonl


def generate(work: Path, mb: int) -> tuple[Path, int, int]:
    """Write corpus/train.jsonl of about `mb` MB (text bytes) and a manifest; returns (dir, docs, bytes)."""
    base = work / "local"
    if not (base / MANIFEST_FILE).is_file():
        build_local_corpus(base)
    docs = list(iter_jsonl(base / TRAIN_FILE))
    out = work / "corpus"
    out.mkdir(parents=True, exist_ok=True)
    target, written, n, copy = mb * 1_000_000, 0, 0, 0
    with open(out / TRAIN_FILE, "w", encoding="utf-8") as fh:
        while written < target:
            for d in docs:
                text = f"{d['text']}\n[copy {copy}]\n"
                fh.write(
                    json.dumps({"id": f"{d['id']}#{copy}", "domain": d["domain"], "text": text}, ensure_ascii=False)
                    + "\n"
                )
                written += len(text.encode("utf-8"))
                n += 1
                if written >= target:
                    break
            copy += 1
    (out / MANIFEST_FILE).write_text(json.dumps({"generated_by": "bench_router", "mb": mb}) + "\n")
    return out, n, written


def shard_child(corpus: str, out: str, paths: int, levels: str | None, fit_sample: int) -> None:
    from router.shards import ShardOptions, shard_corpus

    options = ShardOptions(
        num_paths=paths, fit_sample=fit_sample, levels=[int(x) for x in levels.split(",")] if levels else None
    )
    t0 = time.perf_counter()
    manifest = shard_corpus(Path(corpus), Path(out), options)
    seconds = time.perf_counter() - t0
    rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB
    print(
        json.dumps(
            {
                "seconds": seconds,
                "peak_rss_mb": rss_mb,
                "purity": manifest["purity"],
                "purity_random": manifest["purity_random"],
                "token_shares": manifest["balance"]["token_shares"],
                "satisfied": manifest["balance"]["satisfied"],
            }
        )
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=int, default=1000)
    parser.add_argument("--paths", type=int, default=4)
    parser.add_argument("--levels", default=None)
    parser.add_argument("--fit-sample", type=int, default=50_000)
    parser.add_argument("--workdir", type=Path, default=None)
    parser.add_argument("--keep", action="store_true", help="Keep the generated corpus and shards.")
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        shard_child(args.child[0], args.child[1], args.paths, args.levels, args.fit_sample)
        return
    work = args.workdir or Path(tempfile.mkdtemp(prefix="bench_router-"))
    try:
        t0 = time.perf_counter()
        corpus, n, nbytes = generate(work, args.mb)
        gen_s = time.perf_counter() - t0
        cmd = [
            sys.executable,
            __file__,
            "--paths",
            str(args.paths),
            "--fit-sample",
            str(args.fit_sample),
            "--child",
            str(corpus),
            str(work / "shards"),
        ]
        if args.levels:
            cmd += ["--levels", args.levels]
        child = subprocess.run(cmd, check=True, capture_output=True, text=True)
        result = json.loads(child.stdout.strip().splitlines()[-1])
        mb = nbytes / 1e6
        print(f"generated {mb:.0f} MB ({n} documents) in {gen_s:.0f} s")
        print(
            f"shard_corpus: {result['seconds']:.1f} s, {mb / result['seconds']:.1f} MB/s, "
            f"peak RSS {result['peak_rss_mb']:.0f} MB, {args.paths} paths, purity {result['purity']:.3f} "
            f"(random {result['purity_random']:.3f}), token shares {result['token_shares']} "
            f"(within bounds: {result['satisfied']})"
        )
    finally:
        if not args.keep and args.workdir is None:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
