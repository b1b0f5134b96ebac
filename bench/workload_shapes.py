"""Parameter shapes of the named benchmark workloads (the same as `optfuse bench --workload`)."""


def gpt2_small():
    shapes = [(50257, 768), (1024, 768)]
    for _ in range(12):
        shapes += [(768,), (768,), (768, 2304), (2304,), (768, 768), (768,), (768,), (768,),
                   (768, 3072), (3072,), (3072, 768), (768,)]
    return shapes + [(768,), (768,)]


def llama_1b():
    shapes = [(128256, 2048)]
    for _ in range(16):
        shapes += [(2048,), (2048, 2048), (512, 2048), (512, 2048), (2048, 2048), (2048,),
                   (8192, 2048), (8192, 2048), (2048, 8192)]
    return shapes + [(2048,), (128256, 2048)]


WORKLOADS = {
    "gpt2-small": gpt2_small,
    "llama-1b": llama_1b,
    "many-small": lambda: [(4096,)] * 2000,
    "one-big": lambda: [(268435456,)],
    "cpu-default": lambda: [(64 * 1024 * 1024,)],
}


def shapes(name, scale=1.0):
    """Shapes of a workload, each tensor's element count scaled by `scale` (at least 1 element)."""
    if name not in WORKLOADS:
        raise ValueError(f"unknown workload {name!r}; known: {', '.join(WORKLOADS)}")
    out = []
    for s in WORKLOADS[name]():
        n = 1
        for d in s:
            n *= d
        out.append(s if scale == 1.0 else (max(1, int(n * scale)),))
    return out
