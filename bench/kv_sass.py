"""What the decode attention kernel's inner loop compiles to on an H100/H200, without a GPU.

Why: in the service the fp8 pool's decode attention is 92% of a decode step and runs at the
power-capped clock (bench/results/service_gpu/service_gpu_reading.md, runs 22-25), so what
bounds it is instructions per byte read, not bytes. Triton compiles for sm_90 on any host
(`triton.compile` with a GPUTarget; ptxas and cuobjdump come in the triton wheel), so the
inner loop's SASS can be counted by opcode here, for each pool layout and launch config, the
way the JIT would specialize it in the running loop (pointers and strides divisible by 16,
strides of 1 constant). The loop is the kernel's longest backward branch; one iteration reads
BLOCK_N keys and values of one KV head.

    python bench/kv_sass.py --out bench/results/kv_attention

Writes kv_sass_sm90.md and .json. The figures are static counts, not timings: a GPU run of
bench/kv_attention.py says what they are worth.
"""

from __future__ import annotations

import argparse
import collections
import json
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from ocrq.models.hunyuan.attention import (  # noqa: E402
    FP8_CONFIG,
    KernelConfig,
    _kernels,
    dtype_constants,
)

HEAD_DIM, GROUP = 128, 2  # HunyuanOCR's text decoder: 16 query heads over 8 KV heads of 128


@dataclass(frozen=True)
class Case:
    kv: str  # Triton's name of the pool dtype
    layout: str  # "rows": values token-major (D contiguous); "transposed": tokens contiguous
    padded: bool
    config: KernelConfig

    @property
    def name(self) -> str:
        c = self.config
        return (f"{'fp8' if self.kv.startswith('fp8') else self.kv} {self.layout}"
                f"{' padded' if self.padded else ''} block_n={c.block_n} warps={c.num_warps} "
                f"stages={c.num_stages}{'' if c.exp2 else ' exp'}")


# Up to the transposed pool, the kernel took exp of scaled scores ("exp" in a case's name);
# since, exp2 of scores in log2 units (KernelConfig.exp2).
TWO_WARPS = KernelConfig(block_n=64, num_warps=2, exp2=False)  # the token-major fp8 pool's
CASES = (
    Case("fp8e4nv", "rows", False, TWO_WARPS),  # the running loop's fp8 pool before
    Case("fp8e4nv", "rows", True, TWO_WARPS),
    Case("fp8e4nv", "transposed", False, TWO_WARPS),
    Case("fp8e4nv", "transposed", True, TWO_WARPS),
    Case("fp8e4nv", "transposed", True, replace(FP8_CONFIG, exp2=False)),
    Case("fp8e4nv", "transposed", True, FP8_CONFIG),  # the running loop's fp8 pool now
    Case("bf16", "rows", False, KernelConfig(exp2=False)),
    Case("bf16", "rows", False, KernelConfig()),  # the running loop's bf16 pool
    Case("bf16", "transposed", True, KernelConfig(exp2=False)),
)


def compile_sass(case: Case, workdir: Path) -> str:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    split, _ = _kernels()
    names = list(split.arg_names)
    pointers = {"Q": "*bf16", "K": f"*{case.kv}", "V": f"*{case.kv}", "Start": "*i32",
                "End": "*i32", "Acc": "*fp32", "Mx": "*fp32", "Sm": "*fp32", "Out": "*bf16"}
    const: dict[str, Any] = {
        "G": GROUP, "GP": 16, "D": HEAD_DIM, "BLOCK_N": case.config.block_n,
        "SINGLE": False, "PADDED": case.padded,
        **dtype_constants(case.config, upcast=False, cast_kv=case.kv != "bf16"),
        "s_eb": 1,  # each row its own end (the running loop)
        "s_vl" if case.layout == "transposed" else "s_vd": 1,
    }
    signature = {}
    for n in names:
        if n in pointers:
            signature[n] = pointers[n]
        elif n in const:
            signature[n] = "constexpr"
        else:
            signature[n] = "fp32" if n == "scale" else "i32"
    # The JIT marks pointers and integers divisible by 16 (every stride of a pool whose width
    # is a multiple of 16, and the split length, a multiple of BLOCK_N).
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names)
             if signature[n] != "constexpr" and n != "scale"}
    source = ASTSource(fn=split, signature=signature, attrs=attrs,
                       constexprs={(names.index(k),): v for k, v in const.items()})
    kernel = triton.compile(source, target=GPUTarget("cuda", 90, 32), options={
        "num_warps": case.config.num_warps, "num_stages": case.config.num_stages})
    cubin = workdir / "k.cubin"
    cubin.write_bytes(kernel.asm["cubin"])
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    return subprocess.run([str(tool), "-sass", str(cubin)], capture_output=True, text=True,
                          check=True).stdout


def inner_loop(sass: str) -> list[str]:
    """The instructions of the longest backward branch's range (the loop over key blocks)."""
    code = []
    for line in sass.splitlines():
        m = re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;", line)
        if m:
            code.append((int(m.group(1), 16), m.group(2)))
    loops = []
    for addr, text in code:
        m = re.search(r"\bBRA\b.*?0x([0-9a-f]+)", text)
        if m and int(m.group(1), 16) < addr:
            loops.append((int(m.group(1), 16), addr))
    if not loops:
        raise RuntimeError("no loop found in the SASS")
    lo, hi = max(loops, key=lambda r: r[1] - r[0])
    return [text for addr, text in code if lo <= addr <= hi]


def opcode(text: str) -> str:
    return re.sub(r"^@!?U?P\w+\s+", "", text).split()[0]


def measure(case: Case, workdir: Path) -> dict[str, Any]:
    body = inner_loop(compile_sass(case, workdir))
    counts = collections.Counter(opcode(t) for t in body)
    c = case.config
    warp_instr = len(body) * c.num_warps
    kv_bytes = c.block_n * HEAD_DIM * 2 * (1 if case.kv.startswith("fp8") else 2)
    return {"case": case.name, "kv": case.kv, "layout": case.layout, "padded": case.padded,
            "block_n": c.block_n, "num_warps": c.num_warps, "num_stages": c.num_stages,
            "loop_instructions": len(body), "warp_instructions_per_key": warp_instr / c.block_n,
            "warp_instructions_per_kib": warp_instr / (kv_bytes / 1024),
            "opcodes": dict(counts.most_common())}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--stem", default="kv_sass_sm90")
    args = ap.parse_args()
    import triton

    args.out.mkdir(parents=True, exist_ok=True)
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for case in CASES:
            r = measure(case, Path(tmp))
            results.append(r)
            print(r["case"], r["loop_instructions"], flush=True)
    watch = ("LDS.U8", "F2FP.F16.E4M3.UNPACK_B", "HMMA.16816.F32", "HMMA.16816.F32.BF16",
             "IMAD.MOV.U32", "LDG.E.U8", "STS.U8")
    lines = [
        "# The decode attention's inner loop in sm_90 SASS (static counts, no GPU)", "",
        f"triton {triton.__version__}; HunyuanOCR's 2 query heads per KV head of {HEAD_DIM}; "
        "what the JIT specializes in the running loop (strides divisible by 16, unit strides "
        f"constant). Command: `python bench/kv_sass.py {' '.join(sys.argv[1:])}`.", "",
        "| case | instructions a loop iteration | warp-instructions a key | a KiB read | "
        + " | ".join(watch) + " |",
        "|---|---:|---:|---:|" + "---:|" * len(watch),
    ]
    for r in results:
        ops = r["opcodes"]
        per_key, per_kib = r["warp_instructions_per_key"], r["warp_instructions_per_kib"]
        lines.append(f"| {r['case']} | {r['loop_instructions']} | {per_key:.1f} | {per_kib:.0f} | "
                     + " | ".join(str(ops.get(w, 0)) for w in watch) + " |")
    (args.out / f"{args.stem}.md").write_text("\n".join(lines) + "\n")
    (args.out / f"{args.stem}.json").write_text(json.dumps({"results": results}, indent=1))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
