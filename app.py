"""Start the demo: python app.py [--pair bundled|tiny|TARGET_ID,DRAFT_ID] [--host H] [--port P] [--share]"""
from __future__ import annotations

import argparse
import gc
import os
import threading

from specdec_core.config import TARGET_QUANTS
from specdec_core.models.files import begin_bundled


def options(argv=None) -> argparse.Namespace:
    env = os.environ.get
    ap = argparse.ArgumentParser(description="Speculative decoding, live: a race against plain decoding.")
    ap.add_argument("--pair", default=env("SPECDEC_PAIR", "bundled"), help="bundled | tiny | TARGET,DRAFT | none: TARGET and DRAFT Hub ids (safetensors), or "
                         "GGUF models each: a path, ollama:NAME[:TAG], or a Hub repository's quant (OWNER/REPO:q4_k_m)")
    ap.add_argument("--host", default=env("SPECDEC_HOST", env("GRADIO_SERVER_NAME", "127.0.0.1")))
    ap.add_argument("--port", type=int, default=int(env("SPECDEC_PORT", env("GRADIO_SERVER_PORT", "7860"))))
    ap.add_argument("--share", action="store_true", default=env("SPECDEC_SHARE") == "1")
    ap.add_argument("--local-models", action="store_true", default=env("SPECDEC_LOCAL_MODELS") == "1",
                    help="visitors may load model directories, GGUF files and Ollama models on this server (off by "
                         "default)")
    ap.add_argument("--device", default=env("SPECDEC_DEVICE", "auto"))
    ap.add_argument("--dtype", default=env("SPECDEC_DTYPE", "auto"))
    # ZeroGPU lends a GPU only inside spaces.GPU calls, so nothing can be compiled for it at start-up
    zero_gpu = env("SPACES_ZERO_GPU", "").lower() in ("1", "true")
    ap.add_argument("--graphs", default=env("SPECDEC_GRAPHS", "off" if zero_gpu else "auto"),
                    help="CUDA: compile decoding steps with CUDA graphs (auto = inductor on CUDA; off starts faster)")
    ap.add_argument("--target-quant", default=env("SPECDEC_TARGET_QUANT", "auto"), choices=TARGET_QUANTS,
                    help="auto: on CPUs an exact target (greedy output always plain decoding's): on GGUF blocks "
                         "where AVX-512 VNNI runs them (a GGUF target's own, a Hub target's made Q8_0), else int8; "
                         "int8: int8 from its values; off: its values as loaded")
    ap.add_argument("--concurrency", type=int, default=int(env("SPECDEC_CONCURRENCY", "1")),
                    help="generations run at once (1 keeps timings fair on a CPU)")
    ap.add_argument("--queue-size", type=int, default=int(env("SPECDEC_QUEUE_SIZE", "32")))
    args = ap.parse_args(argv)
    args.zero_gpu = zero_gpu
    args.hosted = env("SPECDEC_HOSTED") == "1" or bool(env("SPACE_ID")) or args.share  # a public link is public
    allowed = env("SPECDEC_ALLOWED_MODELS", "").split(",") + args.pair.split(",")  # the pair it starts with, too
    args.allowlist = frozenset(x.strip() for x in allowed if x.strip())
    args.visitor_tokens = int(env("SPECDEC_VISITOR_TOKENS", "20000"))
    args.max_prompt_tokens = int(env("SPECDEC_MAX_PROMPT_TOKENS", "1024"))  # hosted: a prompt's prefill stays seconds
    return args


def settle_memory(load: threading.Thread | None) -> None:
    """The cyclic collector back on once the pair has loaded, start-up's garbage collected. (Not frozen: a pair a
    visitor replaces later must stay collectable.)"""
    if load is not None:
        load.join()
    gc.collect()
    gc.enable()


def main(argv=None):
    # a start makes about a million objects and frees few: collecting as it went cost a warm start about a second
    gc.disable()
    args = options(argv)
    if args.pair == "bundled":  # its files hashed on a core the imports below leave idle for seconds
        begin_bundled("bfloat16" if args.dtype == "auto" else args.dtype)
    from app.limits import VisitorLimits
    from app.pairs import PairManager

    # on ZeroGPU there is no GPU to time at start-up
    manager = PairManager(args.device, args.dtype, allow_custom=not args.hosted, allowlist=args.allowlist,
                          graphs=args.graphs, probe=not args.zero_gpu, target_quant=args.target_quant,
                          allow_local=args.local_models)
    limits = VisitorLimits(args.visitor_tokens, max_prompt_tokens=args.max_prompt_tokens) if args.hosted else None
    load = None
    if args.pair == "none":  # e.g. a lecture laptop that only replays recorded traces
        manager.say("status_replay")
    else:
        load = manager.load_in_background(args.pair)  # the page is up at once and shows loading progress
    from app.ui import build_app, launch  # gradio's import (seconds) while the pair loads

    demo = build_app(manager, limits)
    threading.Thread(target=settle_memory, args=(load,), daemon=True, name="settle memory").start()
    demo.queue(max_size=args.queue_size, default_concurrency_limit=args.concurrency)
    launch(demo, server_name=args.host, server_port=args.port, share=args.share)


if __name__ == "__main__":
    main()
