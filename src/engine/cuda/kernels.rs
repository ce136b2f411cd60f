//! The CUDA C sources in `kernels/`, compiled by NVRTC when an executor starts (for the GPU it
//! runs on), and the functions the step launches.

use super::gpu_error;
use crate::engine::kv::BLOCK_TOKENS;
use crate::error::{EngineError, EngineResult};
use cudarc::driver::{CudaContext, CudaFunction, CudaModule};
use cudarc::nvrtc::{compile_ptx_with_opts, CompileError, CompileOptions, Ptx};
use std::collections::HashMap;
use std::sync::Arc;

/// Prepended to every source: the shared reductions.
const COMMON: &str = include_str!("../../../kernels/common.cuh");

/// Every kernel source by file name.
pub const SOURCES: [(&str, &str); 5] = [
    (
        "elementwise.cu",
        include_str!("../../../kernels/elementwise.cu"),
    ),
    ("kv.cu", include_str!("../../../kernels/kv.cu")),
    (
        "attention.cu",
        include_str!("../../../kernels/attention.cu"),
    ),
    ("quant.cu", include_str!("../../../kernels/quant.cu")),
    ("sampling.cu", include_str!("../../../kernels/sampling.cu")),
];

/// Whether libnvrtc can be loaded (the `nvidia-cuda-nvrtc-cu12` wheel's `lib/` on
/// `LD_LIBRARY_PATH` is enough; no toolkit or GPU needed).
pub fn nvrtc_available() -> bool {
    // SAFETY: only tries to dlopen the library under its usual names.
    unsafe { cudarc::nvrtc::sys::is_culib_present() }
}

/// Compiles one source of `SOURCES` to PTX for a virtual architecture such as `compute_90`.
pub fn compile(name: &str, source: &str, arch: &str) -> EngineResult<Ptx> {
    if !nvrtc_available() {
        return Err(EngineError::Gpu(
            "NVRTC (libnvrtc.so.12) not found: install the `nvidia-cuda-nvrtc-cu12` wheel and put \
             its `nvidia/cuda_nvrtc/lib` directory on LD_LIBRARY_PATH"
                .into(),
        ));
    }
    let program = format!("#define BLOCK_TOKENS {BLOCK_TOKENS}\n{COMMON}\n{source}");
    let options = CompileOptions {
        name: Some(name.to_string()),
        options: vec![format!("--gpu-architecture={arch}")],
        ..Default::default()
    };
    compile_ptx_with_opts(program, options).map_err(|e| {
        let detail = match e {
            CompileError::CompileError { log, .. } => log.to_string_lossy().into_owned(),
            other => format!("{other:?}"),
        };
        EngineError::Gpu(format!("NVRTC cannot compile kernels/{name}: {detail}"))
    })
}

/// Declares the functions the executor launches once: the `Kernels` fields (named as the
/// kernels) and `FUNCTIONS`, which the tests check against the compiled PTX.
macro_rules! kernels {
    ($($name:ident in $file:literal),* $(,)?) => {
        /// The compiled functions one executor launches.
        pub struct Kernels {
            $(pub $name: CudaFunction,)*
        }

        /// Every kernel the executor launches, as `(source file, function)`.
        pub const FUNCTIONS: &[(&str, &str)] = &[$(($file, stringify!($name)),)*];

        impl Kernels {
            fn from_modules(modules: &HashMap<&str, Arc<CudaModule>>) -> EngineResult<Self> {
                Ok(Self {
                    $($name: function(modules, $file, stringify!($name))?,)*
                })
            }
        }
    };
}

kernels! {
    rms_norm in "elementwise.cu",
    rms_norm_heads in "elementwise.cu",
    embed_rows in "elementwise.cu",
    add_in_place in "elementwise.cu",
    add_bias_rows in "elementwise.cu",
    silu_mul in "elementwise.cu",
    gelu_tanh_mul in "elementwise.cu",
    gather_rows in "elementwise.cu",
    to_bf16 in "elementwise.cu",
    rope_kv_append in "kv.cu",
    kv_copy_blocks in "kv.cu",
    paged_attention in "attention.cu",
    quantize_q8 in "quant.cu",
    rms_norm_quantize_q8 in "quant.cu",
    qmatmul_q8_0 in "quant.cu",
    qmatmul_q4 in "quant.cu",
    qmatmul_q5 in "quant.cu",
    qmatmul_q6_k in "quant.cu",
    logit_stats in "sampling.cu",
    top_k in "sampling.cu",
}

fn function(
    modules: &HashMap<&str, Arc<CudaModule>>,
    file: &str,
    name: &str,
) -> EngineResult<CudaFunction> {
    modules[file]
        .load_function(name)
        .map_err(|e| EngineError::Gpu(format!("kernels/{file}: `{name}`: {e}")))
}

impl Kernels {
    /// Compiles every source for `context`'s GPU and loads its functions.
    pub fn load(context: &Arc<CudaContext>) -> EngineResult<Self> {
        let (major, minor) = context.compute_capability().map_err(gpu_error)?;
        if (major, minor) < (6, 1) {
            return Err(EngineError::Gpu(format!(
                "compute capability {major}.{minor} is too old: the integer-dot kernels need 6.1"
            )));
        }
        let arch = format!("compute_{major}{minor}");
        let mut modules: HashMap<&str, Arc<CudaModule>> = HashMap::new();
        for (name, source) in SOURCES {
            let ptx = compile(name, source, &arch)?;
            modules.insert(name, context.load_module(ptx).map_err(gpu_error)?);
        }
        Self::from_modules(&modules)
    }
}
