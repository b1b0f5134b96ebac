"""Parameter shapes of the named benchmark workloads (the same as `optfuse bench --workload`, except
the two of parameters of more than 2 dimensions, which only the torch benchmarks use: Adafactor
factors each matrix of their last two dimensions)."""


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


def moe_experts():
    """Mixture-of-experts FFN weights stored batched, (experts, rows, cols): 8 layers of 8 experts of
    a 2048-wide model with 1408-wide experts (Qwen1.5-MoE-like shapes)."""
    return [(8, 2048, 1408), (8, 2048, 1408), (8, 1408, 2048)] * 8


def resnet50_convs():
    """ResNet-50's convolution weights, (out, in, kh, kw): matrices of 7 x 7, 3 x 3 and 1 x 1."""
    shapes, inp = [(64, 3, 7, 7)], 64
    for width, blocks in [(64, 3), (128, 4), (256, 6), (512, 3)]:
        for b in range(blocks):
            shapes += [(width, inp, 1, 1), (width, width, 3, 3), (4 * width, width, 1, 1)]
            if b == 0:
                shapes.append((4 * width, inp, 1, 1))  # the projection shortcut
            inp = 4 * width
    return shapes


WORKLOADS = {
    "moe-experts": moe_experts,
    "resnet50-convs": resnet50_convs,
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
