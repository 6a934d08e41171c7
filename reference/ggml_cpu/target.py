"""The CPU builds of llama.cpp the mode models (`--cpu TARGET`): what each one compiles that rounds
differently (docs/ggml-cpu-numerics.md, a section per target). A target is a parameter of the kernel
families, never a copy of them: the register width of the float kernels, which ggml_v_expf, which
weight types the CPU_REPACK buffer takes, whether the tiled kernel exists, the ARM kernels, and for
the ARM builds the compiler, whose contractions round differently (GCC 12 or clang 14, as macOS
builds), and below AVX2 whether FMA exists at all. The NEON targets emulate every weight type with
CPU_REPACK off and on (mul_mat.NEON_REPACKED_EPILOGUES); the pre-AVX2 x86 variants the float weights
and Q8_0."""
import os
import platform
import re
from dataclasses import dataclass, replace

from .build import BUILD_GLIBC, GgmlCpuError


@dataclass(frozen=True)
class Target:
    name: str
    lanes: int  # float32 lanes of GGML_F32_VEC: tinyBLAS's KN, vec_dot_f32/f16's EPR, the soft_max/silu blocks
    scalef: bool  # ggml_v_expf ends in vscalefps (AVX512) rather than k + k*j by FMA (AVX2, NEON)
    dpbf16: bool  # BF16 dots by vdpbf16ps (AVX512_BF16) rather than widened to f32
    repacked: tuple  # weight types CPU_REPACK holds (rows a multiple of 8)
    tiled: bool  # the tiled quantized kernel (tiled/) exists: x86 only
    rope_group: int  # rope_norm pairs GCC vectorises together; the last (pairs mod rope_group) are not contracted
    neox_group: int  # the same for rope_neox
    machine: str  # platform.machine() of the hosts that run this build
    cpu_flags: tuple  # /proc/cpuinfo flags the build needs
    neon: bool = False  # the ARM kernels: arch/arm/quants.c, tinyBLAS_Q0_ARM, F16 arithmetic in half precision
    llamafile: bool = True  # GGML_USE_LLAMAFILE: tinyBLAS takes float (and Q8_0/Q4_0 on ARM) batches of 2+ rows
    mmla: bool = False  # __ARM_FEATURE_MATMUL_INT8: Q4_0/Q4_1/Q8_0/Q4_K/Q6_K vec_dots of 2 rows x 2 rows (nrc == 2)
    rope_sin_fused: bool = False  # rope_norm's vectorised x0*c - x1*s fused on the sin product (NEON's fmls)
    rope_tail_fused: bool = False  # the last (pairs mod rope_group) pairs by scalar FMAs rather than plain
    compiler: str = "gcc"  # the build's compiler: "gcc" (Debian's GCC 12) or "clang" (clang 14, ARM targets)
    fma: bool = True  # FMA compiled in: the FMA intrinsics and GCC's contractions (without: a*b + c rounds twice)
    avx: bool = True  # x86 only: AVX compiled in (the SSE2 soft_max/cvar loops reduce their registers by movehl then)
    block_width: int = 0  # soft_max/silu/cvar register width where it is not `lanes` (their SSE2 loops below AVX2: 4)
    float_sgemm: tuple = ("F32", "F16", "BF16")  # the float weight types llamafile_sgemm takes on this build
    quantized: bool = True  # the quantized kernels are emulated (the pre-AVX2 x86 targets: F32/F16/BF16 weights only)

    @property
    def blocks(self):  # float32 lanes of the soft_max, silu/swiglu and cvar loops (vec.cpp)
        return self.block_width or self.lanes

    @property
    def accumulators(self):  # GGML_F32_ARR = GGML_F32_STEP / GGML_F32_EPR: vec_dot_f32/f16's registers
        """AVX512 64/16, AVX 32/8, NEON 16/4: 4; SSE 32/4: 8 (llama.cpp/ggml/src/ggml-cpu/simd-mappings.h:905-906)."""
        return 8 if self.lanes == 4 and not self.neon else 4

    @property
    def mla_fused(self):  # vmlaq_f32 / vmlaq_n_f32 / vmlsq_f32 as one FMA rather than a multiply and an add
        """clang's arm_neon.h writes them as one C expression, `__p0 + __p1 * __p2` (clang 14's
        arm_neon.h:14493, 14947, 15155), which it contracts (-ffp-contract=on); GCC 12's are builtins
        it expands to fmul + fadd (GCC 12 arm_neon.h:6840-6843, 19162-19165, 19360-19363)."""
        return self.compiler == "clang"

    @property
    def contracts_across_statements(self):  # a product fused into the add of another statement (GCC on aarch64)
        """GCC's default -ffp-contract=fast contracts after inlining, across statements, wherever FMA is
        baseline (aarch64): nearest_int(iscale*x) in quantize_row_q8_K_ref, the i8mm Q4_1 minimums,
        llama-perplexity's u16 codes. clang contracts only within one expression, so those products
        are rounded first, as on x86 (where the x86 code is SIMD or built without FMA)."""
        return self.neon and self.compiler == "gcc"

    @property
    def f16_lanes(self):  # halves per F16 register: GGML_F16_EPR, tinyBLAS's KN for F16 weights
        """With FP16 vector arithmetic (NEON fp16) a register holds 8 halves and the FMAs round to half
        (llama.cpp/ggml/src/ggml-cpu/simd-mappings.h:378-400); x86 converts to the float32 lanes."""
        return 8 if self.neon else self.lanes

    def sgemm_min_rows(self, kind):  # F32/F16/BF16 -> the fewest batch rows llamafile_sgemm takes for that type, or None
        """None where the build's tinyBLAS has no kernel for it (float_sgemm); n < 2 is refused everywhere (llama.cpp/ggml/src/ggml-cpu/llamafile/sgemm.cpp:3819-3822); the NEON
        float kernels want n >= 4 (F32, sgemm.cpp:3845-3846) and n >= 8 (F16, sgemm.cpp:3974-3975)."""
        if kind not in self.float_sgemm:
            return None
        if not self.neon:
            return 2
        return {"F32": 4, "F16": 8}.get(kind, 2)


NEON_REPACKED = ("Q4_0", "IQ4_NL", "Q4_K", "Q5_K", "Q6_K", "Q8_0", "Q1_0")
NEON = Target("neon", 4, False, False, NEON_REPACKED, False, 4, 4, "aarch64", ("asimddp", "fphp"),
              neon=True, rope_sin_fused=True, rope_tail_fused=True)
NEON_I8MM = replace(NEON, name="neon-i8mm", cpu_flags=("asimddp", "fphp", "i8mm"), llamafile=False, mmla=True)


def clang_build(gcc_target):  # an ARM Target -> the same build compiled by clang
    """rotate_pairs' x0*c - x1*s and x0*s + x1*c (llama.cpp/ggml/src/ggml-cpu/ops.cpp:6305-6306) each
    contracted on its first product in every pair, vectorised or not: fma(x0, c, -(x1*s)),
    fma(x0, s, x1*c)."""
    return replace(gcc_target, name=f"{gcc_target.name}-clang", compiler="clang", rope_sin_fused=False,
                   rope_tail_fused=True)


CLANG_BUILDS = {t.name: clang_build(t) for t in (NEON, NEON_I8MM)}  # GCC target name -> the clang build
AVX2 = Target("avx2", 8, False, False, ("Q4_0", "IQ4_NL", "Q4_K"), True, 2, 1, "x86_64", ("avx2", "fma", "f16c", "bmi2"))
# llama.cpp's x86 variants below AVX2 (docs/ggml-cpu-numerics.md, "Below AVX2"): no CPU_REPACK layout (x86's need
# AVX2), no tiled kernel, the SSE2 soft_max/silu loops; FMA only on piledriver, tinyBLAS for F16 only with F16C
SANDYBRIDGE = replace(AVX2, name="sandybridge", repacked=(), tiled=False, cpu_flags=("avx",), fma=False,
                      block_width=4, float_sgemm=("F32",), quantized=False)
IVYBRIDGE = replace(SANDYBRIDGE, name="ivybridge", cpu_flags=("avx", "f16c"), float_sgemm=("F32", "F16"))
PILEDRIVER = replace(IVYBRIDGE, name="piledriver", cpu_flags=("avx", "f16c", "fma"), fma=True)
SSE42 = replace(SANDYBRIDGE, name="sse42", lanes=4, cpu_flags=("sse4_2",), avx=False, float_sgemm=())
X64 = replace(SSE42, name="x64", lanes=0, cpu_flags=())  # no GGML_SIMD (it needs SSE3): scalar vec_dots
PRE_AVX2 = (SANDYBRIDGE, IVYBRIDGE, PILEDRIVER, SSE42, X64)
TARGETS = {t.name: t for t in (
    AVX2,
    Target("avx512", 16, True, True, ("Q4_0", "IQ4_NL", "Q4_K", "Q2_K"), True, 4, 4, "x86_64",
           ("avx512f", "avx512bw", "avx512dq", "avx512vl", "avx512_vnni", "avx512_bf16", "fma", "f16c")),
    NEON, NEON_I8MM, *CLANG_BUILDS.values(), *PRE_AVX2,
)}
DEFAULT_TARGET = "avx512"


HASWELL = ("SSE42", "AVX", "F16C", "FMA", "AVX2", "BMI2")
AVX512_BASE = HASWELL + ("AVX512",)
X86_VARIANTS = {  # llama.cpp's x86 CPU variants (GGML_CPU_ALL_VARIANTS, ggml/src/CMakeLists.txt:494-519) -> ISA features
    "x64": (), "sse42": ("SSE42",), "sandybridge": ("SSE42", "AVX"), "ivybridge": ("SSE42", "AVX", "F16C"),
    "piledriver": ("SSE42", "AVX", "F16C", "FMA"), "haswell": HASWELL, "skylakex": AVX512_BASE,
    "cannonlake": AVX512_BASE + ("AVX512_VBMI",), "cascadelake": AVX512_BASE + ("AVX512_VNNI",),
    "icelake": AVX512_BASE + ("AVX512_VBMI", "AVX512_VNNI"), "cooperlake": AVX512_BASE + ("AVX512_VNNI", "AVX512_BF16"),
    "zen4": AVX512_BASE + ("AVX512_VBMI", "AVX512_VNNI", "AVX512_BF16"), "alderlake": HASWELL + ("AVX_VNNI",),
    "sapphirerapids": AVX512_BASE + ("AVX512_VBMI", "AVX512_VNNI", "AVX512_BF16", "AMX_TILE", "AMX_INT8"),
}
# ggml_backend_cpu_x86_score (ggml-cpu/arch/x86/cpu-feats.cpp:263-322): a feature's weight, and the
# /proc/cpuinfo flags it needs; AMX_TILE is compiled in but not scored
SCORE = {"FMA": (1, ("fma",)), "F16C": (2, ("f16c",)), "SSE42": (4, ("sse4_2",)), "BMI2": (8, ("bmi2",)),
         "AVX": (16, ("avx",)), "AVX2": (32, ("avx2",)), "AVX_VNNI": (64, ("avx_vnni",)),
         "AVX512": (128, ("avx512f", "avx512cd", "avx512vl", "avx512dq", "avx512bw")),
         "AVX512_VBMI": (256, ("avx512vbmi",)), "AVX512_BF16": (512, ("avx512_bf16",)),
         "AVX512_VNNI": (1024, ("avx512_vnni",)), "AMX_INT8": (2048, ("amx_int8",)), "AMX_TILE": (0, ())}
VARIANT_TARGET = {  # variant -> the modelled build that rounds as it does
    "haswell": "avx2",  # the same -m flags as the avx2 build (docs/ggml-cpu-numerics.md)
    "alderlake": "avx2",  # + AVX-VNNI: vpdpbusd gives maddubs+madd's integers (no saturation on ggml's codes)
    "cooperlake": "avx512", "zen4": "avx512",  # AVX512 with VNNI and BF16, as the avx512 build (VBMI: integer shuffles)
    **{t.name: t.name for t in PRE_AVX2},  # each a class of its own
}
BF16_LESS = ("without AVX512_BF16 its BF16 products take the AVX512F path (vec.cpp:159-170, sgemm.cpp:3902-3909), "
             "not emulated; on weights without BF16 it rounds as avx512")
VARIANT_REFUSED = {
    **{v: BF16_LESS for v in ("skylakex", "cannonlake", "cascadelake", "icelake")},
    "sapphirerapids": "its AMX buffer type (ggml-cpu/amx/) takes quantized weights by AMX tiles, not emulated, and needs "
                      "AMX (absent from the CPUs here); its plain buffers round as avx512",
}
CPU_CHOICES = tuple(dict.fromkeys((*TARGETS, *X86_VARIANTS, "auto")))  # what --cpu takes: the modelled builds, llama.cpp's variant names, auto


def variant_score(variant, flags):  # variant name, the CPU's /proc/cpuinfo flags -> llama.cpp's score (0: cannot load)
    score = 1
    for feature in X86_VARIANTS[variant]:
        weight, needs = SCORE[feature]
        if not set(needs) <= set(flags):
            return 0
        score += weight
    return score


def cpu_flags():  # -> this CPU's /proc/cpuinfo flags ([] where there is none)
    if not os.path.exists("/proc/cpuinfo"):
        return []
    with open("/proc/cpuinfo") as f:
        return next((line.split(":", 1)[1].split() for line in f if line.startswith(("flags", "Features"))), [])


def host_variant(flags=None):  # -> the x86 variant ggml_backend_load_best would load on this CPU, or GgmlCpuError
    """The highest score wins, the first found on a tie (ggml/src/ggml-backend-reg.cpp:504-555)."""
    if platform.machine() not in ("x86_64", "AMD64"):
        raise GgmlCpuError(f"--cpu auto picks among llama.cpp's x86 variants; this CPU is {platform.machine()}")
    flags = cpu_flags() if flags is None else flags
    return max(X86_VARIANTS, key=lambda v: variant_score(v, flags))


def target(name):  # a build name (TARGETS), a llama.cpp x86 variant name, or "auto" -> Target, or GgmlCpuError
    if name == "auto":
        name = host_variant()
    if name in VARIANT_TARGET:
        return TARGETS[VARIANT_TARGET[name]]
    if name in VARIANT_REFUSED:
        raise GgmlCpuError(f"llama.cpp's {name} variant: {VARIANT_REFUSED[name]}")
    if name not in TARGETS:
        raise GgmlCpuError(f"unknown CPU target {name!r} ({', '.join(CPU_CHOICES)})")
    return TARGETS[name]


SYSTEM_INFO_FEATURE = re.compile(r"\b([A-Z0-9_]+) = 1\b")


def target_of_system_info(text):  # llama.cpp's system_info line(s) -> the target name they show, or None
    """ggml_cpu_get_features lists the features the build was compiled with (ggml-cpu.cpp:547-645):
    AVX512 builds also show AVX2, i8mm builds (MATMUL_INT8) also DOTPROD. It does not name the
    compiler: an ARM line is read as the GCC build (CLANG_BUILDS holds the clang one). The x64 variant
    shows no x86 feature at all, which no line can tell from another architecture's: its load line does."""
    on = set(SYSTEM_INFO_FEATURE.findall(text))
    if "AVX512" in on:
        return "avx512"
    if {"AVX2", "FMA", "F16C"} <= on:
        return "avx2"
    if "AVX" in on:  # below AVX2: llama.cpp's sandybridge, ivybridge and piledriver variants
        return "piledriver" if {"FMA", "F16C"} <= on else "ivybridge" if "F16C" in on else "sandybridge"
    if "SSSE3" in on:
        return "sse42"
    if {"NEON", "DOTPROD"} <= on:
        return "neon-i8mm" if "MATMUL_INT8" in on else "neon"
    return None


AVX512 = TARGETS[DEFAULT_TARGET]


def host_differences(chosen=AVX512):  # Target -> [str]: how this machine's llama.cpp build would differ from it
    """A machine of another architecture, or one whose CPU lacks the target's features, cannot run
    that build; glibc's expf/cosf/sinf/tanhf may differ in the last bit from the modelled 2.36."""
    found = []
    if platform.machine() != chosen.machine:
        found.append(f"CPU architecture {platform.machine()}, not {chosen.machine}")
    elif os.path.exists("/proc/cpuinfo"):
        flags = cpu_flags()
        missing = [flag for flag in chosen.cpu_flags if flag not in flags]
        if missing:
            found.append(f"CPU lacks {' '.join(missing)}")
    libc, version = platform.libc_ver()
    if (libc, version) != ("glibc", BUILD_GLIBC):
        found.append(f"C library {libc or 'unknown'} {version}, not glibc {BUILD_GLIBC} (expf/cosf/sinf/tanhf "
                     "may differ in the last bit)")
    return found
