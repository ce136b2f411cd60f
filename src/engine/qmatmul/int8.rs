//! Integer-dot kernels for Q8_0, Q4_0 and Q4_1 weights against 8-bit activation rows. Each
//! weight block is decoded once per step and applied to a tile of rows, so a step over B rows
//! reads the weights once rather than B times. Every row keeps its own accumulators and the
//! same operation sequence whatever its tile, so results never depend on batch-mates.

use super::activations::{padded_blocks, QuantizedRows, BLOCK};
#[cfg(target_arch = "x86_64")]
use super::simd::{avx2, vnni};
use candle_core::quantized::GgmlDType;
use half::f16;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Int8Format {
    /// weight = d · q, q ∈ i8.
    Q8_0,
    /// weight = d · (n − 8), n ∈ 0..16.
    Q4_0,
    /// weight = d · n + m, n ∈ 0..16.
    Q4_1,
}

impl Int8Format {
    pub fn of(dtype: GgmlDType) -> Option<Self> {
        match dtype {
            GgmlDType::Q8_0 => Some(Self::Q8_0),
            GgmlDType::Q4_0 => Some(Self::Q4_0),
            GgmlDType::Q4_1 => Some(Self::Q4_1),
            _ => None,
        }
    }

    pub fn dtype(self) -> GgmlDType {
        match self {
            Self::Q8_0 => GgmlDType::Q8_0,
            Self::Q4_0 => GgmlDType::Q4_0,
            Self::Q4_1 => GgmlDType::Q4_1,
        }
    }

    /// Bytes per block in a GGUF file: f16 scale, Q4_1's f16 minimum, then the quants.
    pub fn file_block_bytes(self) -> usize {
        2 + self.min_bytes() + self.quant_bytes()
    }

    fn min_bytes(self) -> usize {
        if self == Self::Q4_1 {
            2
        } else {
            0
        }
    }

    /// Quant bytes per block: 32 signed bytes, or 16 bytes of two nibbles (element j in the
    /// low nibble of byte j, element j + 16 in its high nibble).
    pub fn quant_bytes(self) -> usize {
        match self {
            Self::Q8_0 => BLOCK,
            Self::Q4_0 | Self::Q4_1 => BLOCK / 2,
        }
    }
}

/// Quant bytes in 32-byte aligned units, so SIMD loads never straddle cache lines.
#[derive(Clone, Copy)]
#[repr(C, align(32))]
struct Aligned([u8; 32]);

/// A `[n_out, k_in]` matrix repacked from ggml's interleaved blocks into separate arrays:
/// quants contiguous per output column, scales (and Q4_1 minimums) contiguous beside them, so
/// a column's headers convert to f32 in a few vector instructions. Same bytes as the file.
pub struct PackedInt8 {
    format: Int8Format,
    blocks_per_row: usize,
    quants: Vec<Aligned>,
    scales: Vec<f16>,
    /// Q4_1's per-block minimums; empty for the other formats.
    mins: Vec<f16>,
}

impl PackedInt8 {
    /// `bytes` holds `n_out · blocks_per_row` blocks in ggml's layout.
    pub fn from_ggml(format: Int8Format, bytes: &[u8], blocks_per_row: usize) -> Self {
        let blocks = bytes.len() / format.file_block_bytes();
        let quant_bytes = format.quant_bytes();
        let mut quants = vec![Aligned([0; 32]); (blocks * quant_bytes).div_ceil(32)];
        let flat = bytes_mut(&mut quants);
        let (mut scales, mut mins) = (Vec::with_capacity(blocks), Vec::new());
        for (b, block) in bytes.chunks_exact(format.file_block_bytes()).enumerate() {
            let half = |i: usize| f16::from_le_bytes([block[i], block[i + 1]]);
            scales.push(half(0));
            if format == Int8Format::Q4_1 {
                mins.push(half(2));
            }
            let start = 2 + format.min_bytes();
            flat[b * quant_bytes..(b + 1) * quant_bytes].copy_from_slice(&block[start..]);
        }
        Self {
            format,
            blocks_per_row,
            quants,
            scales,
            mins,
        }
    }

    pub fn format(&self) -> Int8Format {
        self.format
    }

    pub fn block_count(&self) -> usize {
        self.scales.len()
    }

    /// Column `col`'s quant bytes.
    fn column_quants(&self, col: usize) -> &[u8] {
        let len = self.blocks_per_row * self.format.quant_bytes();
        &bytes(&self.quants)[col * len..(col + 1) * len]
    }

    /// Column `col`'s block scales and offsets (weight = scale · q + offset) as f32.
    fn decode_column(&self, col: usize, scales: &mut [f32], offsets: &mut [f32]) {
        let blocks = col * self.blocks_per_row..(col + 1) * self.blocks_per_row;
        widen(&self.scales[blocks.clone()], scales);
        match self.format {
            Int8Format::Q8_0 => {}
            Int8Format::Q4_0 => {
                for (o, s) in offsets.iter_mut().zip(scales.iter()) {
                    *o = -8.0 * s;
                }
            }
            Int8Format::Q4_1 => widen(&self.mins[blocks], offsets),
        }
    }

    /// Every block's quant bytes, column after column (`block_count · quant_bytes`).
    pub fn quant_bytes(&self) -> &[u8] {
        &bytes(&self.quants)[..self.block_count() * self.format.quant_bytes()]
    }

    /// Every block's scale and offset as f32, `[n_out, blocks_per_row]` each (weight =
    /// scale · q + offset; offsets are zero for Q8_0).
    pub fn scales_and_offsets(&self) -> (Vec<f32>, Vec<f32>) {
        let mut scales = vec![0f32; self.block_count()];
        let mut offsets = vec![0f32; self.block_count()];
        for (col, (s, o)) in scales
            .chunks_mut(self.blocks_per_row)
            .zip(offsets.chunks_mut(self.blocks_per_row))
            .enumerate()
        {
            self.decode_column(col, s, o);
        }
        (scales, offsets)
    }

    /// The weights as f32, row-major `[n_out, k_in]`.
    pub fn dequantize(&self) -> Vec<f32> {
        let quant_bytes = self.format.quant_bytes();
        let quants = bytes(&self.quants);
        let mut out = Vec::with_capacity(self.block_count() * BLOCK);
        for b in 0..self.block_count() {
            let q = &quants[b * quant_bytes..(b + 1) * quant_bytes];
            let d = self.scales[b].to_f32();
            match self.format {
                Int8Format::Q8_0 => out.extend(q.iter().map(|&v| d * v as i8 as f32)),
                Int8Format::Q4_0 | Int8Format::Q4_1 => {
                    let m = self.mins.get(b).map_or(-8.0 * d, |m| m.to_f32());
                    out.extend(q.iter().map(|&v| d * (v & 0x0F) as f32 + m));
                    out.extend(q.iter().map(|&v| d * (v >> 4) as f32 + m));
                }
            }
        }
        out
    }
}

/// f16 → f32, one `vcvtph2ps` per value where the build has F16C (`half`'s slice conversion
/// goes through a stack copy that stalls store forwarding).
fn widen(src: &[f16], dst: &mut [f32]) {
    for (d, s) in dst.iter_mut().zip(src) {
        *d = s.to_f32();
    }
}

fn bytes(chunks: &[Aligned]) -> &[u8] {
    // SAFETY: `Aligned` is `repr(C)` over `[u8; 32]` with no padding.
    unsafe { std::slice::from_raw_parts(chunks.as_ptr() as *const u8, chunks.len() * 32) }
}

fn bytes_mut(chunks: &mut [Aligned]) -> &mut [u8] {
    // SAFETY: as in `bytes`; any byte pattern is a valid `Aligned`.
    unsafe { std::slice::from_raw_parts_mut(chunks.as_mut_ptr() as *mut u8, chunks.len() * 32) }
}

/// Which implementation runs; chosen once per matmul from the CPU's features.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kernel {
    #[cfg(target_arch = "x86_64")]
    Avx512Vnni,
    #[cfg(target_arch = "x86_64")]
    Avx2,
    Portable,
}

impl Kernel {
    /// The fastest kernel this CPU runs.
    pub fn detect() -> Self {
        Self::available()[0]
    }

    /// Every kernel this CPU can run, fastest first (tests compare them all).
    pub fn available() -> Vec<Self> {
        let mut all = Vec::new();
        #[cfg(target_arch = "x86_64")]
        {
            use std::is_x86_feature_detected as has;
            if has!("avx2") && has!("fma") {
                if has!("avx512f") && has!("avx512bw") && has!("avx512vnni") && has!("avx512vl") {
                    all.push(Self::Avx512Vnni);
                }
                all.push(Self::Avx2);
            }
        }
        all.push(Self::Portable);
        all
    }
}

/// Cuts `out.len()` rows starting at `first_row` into tiles of 8, 4, 2 and 1 and calls
/// `module::tile::<TILE>(args.., row, tile_out)` with the tile size as a constant (so the
/// tile's accumulators live in registers).
macro_rules! tiled {
    ($out:ident, $first_row:ident, $module:ident::$tile:ident($($arg:expr),*)) => {{
        let mut done = 0;
        while done < $out.len() {
            let (row, tile) = ($first_row + done, &mut $out[done..]);
            done += match tile.len() {
                8.. => { $module::$tile::<8>($($arg,)* row, tile); 8 }
                4.. => { $module::$tile::<4>($($arg,)* row, tile); 4 }
                2.. => { $module::$tile::<2>($($arg,)* row, tile); 2 }
                _ => { $module::$tile::<1>($($arg,)* row, tile); 1 }
            };
        }
    }};
}

/// Fills `out` (rows `first_row..`) with the chosen kernel: the SIMD module's `$tile` over
/// row tiles, or `$portable(args.., row)` row by row.
macro_rules! run_kernel {
    ($kernel:expr, $out:ident, $first_row:ident, $tile:ident($($arg:expr),*), $portable:ident) => {
        match $kernel {
            #[cfg(target_arch = "x86_64")]
            // SAFETY: `available` lists a SIMD kernel only where its features were detected.
            Kernel::Avx512Vnni => unsafe { tiled!($out, $first_row, vnni::$tile($($arg),*)) },
            #[cfg(target_arch = "x86_64")]
            // SAFETY: as above.
            Kernel::Avx2 => unsafe { tiled!($out, $first_row, avx2::$tile($($arg),*)) },
            Kernel::Portable => {
                for (i, slot) in $out.iter_mut().enumerate() {
                    *slot = $portable($($arg,)* $first_row + i);
                }
            }
        }
    };
}

/// Rows handled per pass over a column range: their quants stay in L1/L2 while the columns'
/// weights stream past.
const ROW_CHUNK: usize = 64;

/// Dot products of weight rows (output columns) `first_col..` with every activation row, into
/// `out` laid out `[columns, rows]` (column-major: one column's rows are contiguous).
pub fn columns(
    kernel: Kernel,
    weights: &PackedInt8,
    x: &QuantizedRows,
    first_col: usize,
    out: &mut [f32],
) {
    let rows = x.rows();
    if rows == 0 {
        return;
    }
    let nb = x.blocks_per_row();
    let cols = out.len() / rows;
    let mut scales = vec![0f32; nb];
    let mut offsets = vec![0f32; padded_blocks(nb)];
    for chunk_start in (0..rows).step_by(ROW_CHUNK) {
        let chunk_end = (chunk_start + ROW_CHUNK).min(rows);
        for c in 0..cols {
            let col = first_col + c;
            let out = &mut out[c * rows + chunk_start..c * rows + chunk_end];
            weights.decode_column(col, &mut scales, &mut offsets);
            let quants = weights.column_quants(col);
            match weights.format() {
                Int8Format::Q8_0 => {
                    run_kernel!(
                        kernel,
                        out,
                        chunk_start,
                        q8_0_tile(quants, &scales, x),
                        q8_0_dot_portable
                    )
                }
                // Σ_b scale_b · (nibbles_b · row) + Σ_b offset_b · scale_x · Σq_x per row.
                Int8Format::Q4_0 | Int8Format::Q4_1 => {
                    run_kernel!(
                        kernel,
                        out,
                        chunk_start,
                        q4_tile(quants, &scales, &offsets, x),
                        q4_dot_portable
                    )
                }
            }
        }
    }
}

fn q8_0_dot_portable(quants: &[u8], scales: &[f32], x: &QuantizedRows, row: usize) -> f32 {
    let mut acc = 0f32;
    for (b, (block, scale)) in quants.chunks_exact(BLOCK).zip(scales).enumerate() {
        let dot: i32 = block
            .iter()
            .zip(x.block(row, b))
            .map(|(&w, &q)| w as i8 as i32 * q as i32)
            .sum();
        acc += dot as f32 * (scale * x.scale(row, b));
    }
    acc
}

fn q4_dot_portable(
    quants: &[u8],
    scales: &[f32],
    offsets: &[f32],
    x: &QuantizedRows,
    row: usize,
) -> f32 {
    let mut acc = 0f32;
    for (o, s) in offsets.iter().zip(x.row_scaled_sums(row)) {
        acc += o * s;
    }
    for (b, (block, scale)) in quants.chunks_exact(BLOCK / 2).zip(scales).enumerate() {
        let (low, high) = x.block(row, b).split_at(BLOCK / 2);
        let dot: i32 = block
            .iter()
            .zip(low.iter().zip(high))
            .map(|(&n, (&l, &h))| (n & 0x0F) as i32 * l as i32 + (n >> 4) as i32 * h as i32)
            .sum();
        acc += dot as f32 * (scale * x.scale(row, b));
    }
    acc
}
