//! Integer-dot kernels for Q8_0, Q4_0 and Q4_1 weights against 8-bit activation rows. Each
//! weight block is decoded once per step and applied to a tile of rows, so a step over B rows
//! reads the weights once rather than B times. Every row keeps its own accumulators and the
//! same operation sequence whatever its tile, so results never depend on batch-mates.

use super::activations::QuantizedRows;
use super::layout::{groups, stored_blocks, Group, BLOCK};
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
/// each output column's quants in the grouped layout of `layout` (Q4 nibbles paired so one
/// load unpacks two vectors), scales (and Q4_1 minimums) contiguous beside them, so a
/// column's headers convert to f32 in a few vector instructions. Columns with an odd block
/// count get a zero block (scale 0), so every group is whole.
pub struct PackedInt8 {
    format: Int8Format,
    blocks_per_row: usize,
    groups: Vec<Group>,
    quants: Vec<Aligned>,
    /// `[n_out, stored_blocks]`.
    scales: Vec<f16>,
    /// Q4_1's per-block minimums, like `scales`; empty for the other formats.
    mins: Vec<f16>,
}

impl PackedInt8 {
    /// `bytes` holds `n_out · blocks_per_row` blocks in ggml's layout.
    pub fn from_ggml(format: Int8Format, bytes: &[u8], blocks_per_row: usize) -> Self {
        let columns = bytes.len() / format.file_block_bytes() / blocks_per_row.max(1);
        let stored = stored_blocks(blocks_per_row);
        let groups = groups(blocks_per_row);
        let quant_bytes = format.quant_bytes();
        let column_bytes = stored * quant_bytes;
        let mut quants = vec![Aligned([0; 32]); (columns * column_bytes).div_ceil(32)];
        let flat = bytes_mut(&mut quants);
        let headers = columns * stored + HEADER_PADDING;
        let min_count = if format == Int8Format::Q4_1 {
            headers
        } else {
            0
        };
        let (mut scales, mut mins) = (vec![f16::ZERO; headers], vec![f16::ZERO; min_count]);
        for (b, block) in bytes.chunks_exact(format.file_block_bytes()).enumerate() {
            let (col, block_index) = (b / blocks_per_row, b % blocks_per_row);
            let half = |i: usize| f16::from_le_bytes([block[i], block[i + 1]]);
            scales[col * stored + block_index] = half(0);
            if format == Int8Format::Q4_1 {
                mins[col * stored + block_index] = half(2);
            }
            let group = group_of(&groups, block_index);
            let column = &mut flat[col * column_bytes..(col + 1) * column_bytes];
            let group_bytes = &mut column[group.first_block * quant_bytes..];
            let quants = &block[2 + format.min_bytes()..];
            // Four consecutive elements sit at four consecutive positions.
            for element in (0..BLOCK).step_by(4) {
                let first = group.position(block_index - group.first_block, element);
                for (e, position) in (element..element + 4).zip(first..) {
                    match format {
                        Int8Format::Q8_0 => group_bytes[position] = quants[e],
                        Int8Format::Q4_0 | Int8Format::Q4_1 => {
                            let packed = quants[e % (BLOCK / 2)];
                            let nibble = if e < BLOCK / 2 {
                                packed & 0x0F
                            } else {
                                packed >> 4
                            };
                            let (byte, high) = group.nibble_slot(position);
                            group_bytes[byte] |= if high { nibble << 4 } else { nibble };
                        }
                    }
                }
            }
        }
        Self {
            format,
            blocks_per_row,
            groups,
            quants,
            scales,
            mins,
        }
    }

    pub fn format(&self) -> Int8Format {
        self.format
    }

    pub fn columns(&self) -> usize {
        (self.scales.len() - HEADER_PADDING) / stored_blocks(self.blocks_per_row).max(1)
    }

    /// Output column `col` as the kernels read it.
    pub fn column(&self, col: usize) -> Column<'_> {
        let stored = stored_blocks(self.blocks_per_row);
        let len = stored * self.format.quant_bytes();
        Column {
            format: self.format,
            quants: &bytes(&self.quants)[col * len..(col + 1) * len],
            scales: &self.scales[col * stored..],
            mins: self.mins.get(col * stored..).unwrap_or(&[]),
        }
    }

    /// Calls `f(col, block, quants)` for every block in order, with its 32 quants unpacked
    /// (signed bytes for Q8_0, nibbles for Q4).
    fn for_each_block(&self, mut f: impl FnMut(usize, usize, [i32; BLOCK])) {
        for col in 0..self.columns() {
            let column = self.column(col);
            for block in 0..self.blocks_per_row {
                let group = group_of(&self.groups, block);
                let j = block - group.first_block;
                f(
                    col,
                    block,
                    std::array::from_fn(|e| column.quant(group, group.position(j, e))),
                );
            }
        }
    }

    /// Every block's quant bytes in ggml's order (Q4: element j in the low nibble of byte j,
    /// element j + 16 in its high nibble), column after column: `[n_out, blocks_per_row,
    /// quant_bytes]`.
    pub fn block_quants(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(self.columns() * self.blocks_per_row * BLOCK);
        self.for_each_block(|_, _, q| match self.format {
            Int8Format::Q8_0 => out.extend(q.map(|v| v as u8)),
            Int8Format::Q4_0 | Int8Format::Q4_1 => {
                out.extend((0..BLOCK / 2).map(|e| (q[e] | q[e + BLOCK / 2] << 4) as u8))
            }
        });
        out
    }

    /// Every block's scale and offset as f32, `[n_out, blocks_per_row]` each (weight =
    /// scale · q + offset; offsets are zero for Q8_0).
    pub fn scales_and_offsets(&self) -> (Vec<f32>, Vec<f32>) {
        let (mut scales, mut offsets) = (Vec::new(), Vec::new());
        for col in 0..self.columns() {
            let column = self.column(col);
            for block in 0..self.blocks_per_row {
                scales.push(column.scales[block].to_f32());
                offsets.push(column.offset(block));
            }
        }
        (scales, offsets)
    }

    /// The weights as f32, row-major `[n_out, k_in]`.
    pub fn dequantize(&self) -> Vec<f32> {
        let (scales, offsets) = self.scales_and_offsets();
        let mut out = Vec::with_capacity(scales.len() * BLOCK);
        self.for_each_block(|col, block, q| {
            let b = col * self.blocks_per_row + block;
            out.extend(q.map(|v| scales[b] * v as f32 + offsets[b]));
        });
        out
    }
}

/// Header values (scales, minimums) past the last column, so kernels may read a whole
/// register of them from any group.
const HEADER_PADDING: usize = 16;

/// The group that holds block `block`.
fn group_of(groups: &[Group], block: usize) -> Group {
    *groups
        .iter()
        .find(|g| block < g.first_block + g.blocks)
        .expect("the block lies inside the row")
}

/// One output column: what every kernel reads.
pub struct Column<'a> {
    pub format: Int8Format,
    /// Quant bytes in the grouped layout (Q8_0 signed, Q4 nibbles).
    pub quants: &'a [u8],
    /// Block scales from the column's first block on; at least `HEADER_PADDING` values past
    /// its last block are readable (the next column's, or zeros).
    pub scales: &'a [f16],
    /// Q4_1's block minimums, readable like `scales`; empty for the other formats.
    pub mins: &'a [f16],
}

impl Column<'_> {
    /// Block `block`'s offset: weight = scale · q + offset.
    pub fn offset(&self, block: usize) -> f32 {
        match self.format {
            Int8Format::Q8_0 => 0.0,
            Int8Format::Q4_0 => -8.0 * self.scales[block].to_f32(),
            Int8Format::Q4_1 => self.mins[block].to_f32(),
        }
    }

    /// The quant at `position` of group `group`'s unpacked bytes.
    fn quant(&self, group: Group, position: usize) -> i32 {
        match self.format {
            Int8Format::Q8_0 => self.quants[group.first_block * BLOCK + position] as i8 as i32,
            Int8Format::Q4_0 | Int8Format::Q4_1 => {
                let (byte, high) = group.nibble_slot(position);
                let packed = self.quants[group.first_block * BLOCK / 2 + byte];
                (if high { packed >> 4 } else { packed & 0x0F }) as i32
            }
        }
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
            if has!("avx2") && has!("fma") && has!("f16c") {
                if has!("avx512f") && has!("avx512bw") && has!("avx512vnni") && has!("avx512vl") {
                    all.push(Self::Avx512Vnni);
                }
                all.push(Self::Avx2);
            }
        }
        all.push(Self::Portable);
        all
    }

    /// The name `FromStr` reads.
    pub fn name(self) -> &'static str {
        match self {
            #[cfg(target_arch = "x86_64")]
            Self::Avx512Vnni => "avx512-vnni",
            #[cfg(target_arch = "x86_64")]
            Self::Avx2 => "avx2",
            Self::Portable => "portable",
        }
    }
}

impl std::str::FromStr for Kernel {
    type Err = String;

    fn from_str(name: &str) -> Result<Self, Self::Err> {
        let all = [
            #[cfg(target_arch = "x86_64")]
            Self::Avx512Vnni,
            #[cfg(target_arch = "x86_64")]
            Self::Avx2,
            Self::Portable,
        ];
        all.into_iter().find(|k| k.name() == name).ok_or_else(|| {
            let names: Vec<&str> = all.iter().map(|k| k.name()).collect();
            format!("unknown CPU kernel `{name}` (one of {})", names.join(", "))
        })
    }
}

/// Columns `first..first + C` against rows `rows` with a SIMD module's `tile`, over row
/// tiles of the listed sizes, largest first (sizes are constants, so the accumulators live in
/// registers). `out` holds the rows `[rows, stride]` from column `first`.
macro_rules! column_tile {
    (
        $module:ident::<C = $c:literal, R = $($r:literal)|+>,
        $weights:expr, $first:expr, $x:expr, $rows:expr, $out:expr, $stride:expr
    ) => {{
        let columns: [Column; $c] = std::array::from_fn(|i| $weights.column($first + i));
        let mut row = $rows.start;
        while row < $rows.end {
            let (remaining, out) = ($rows.end - row, &mut $out[row * $stride..]);
            row += $(if remaining >= $r {
                $module::tile::<$r, $c>(&columns, $x, row, out, $stride);
                $r
            } else)+ {
                unreachable!("the smallest row tile is 1")
            };
        }
        $c
    }};
}

/// Rows a chunk needs before the VNNI kernel takes two columns per tile (see `columns`).
const TWO_COLUMN_MIN_ROWS: usize = 8;

/// Rows handled per pass over a column range: their quants stay in L1/L2 while the columns'
/// weights stream past.
const ROW_CHUNK: usize = 64;

/// Dot products of weight rows (output columns) `first_col..` with every activation row, into
/// `out` laid out `[rows, columns]`.
///
/// Tile shapes, measured on Zen 4 (1 thread, SmolLM2-sized matrices, 30 layers' worth so the
/// weights stream from memory): with VNNI and 8 or more rows, two columns of up to four rows
/// share each activation load (B = 8: 400 → 376 µs a layer from cache; 64 rows 26 % faster
/// than one column of eight rows; 2 · 4 accumulators and 2 · 4 dot vectors fit the 32
/// registers, 2 · 8 would spill). With fewer rows each column pair gets a single pass, and
/// two interleaved columns streaming from memory ran slower than one (Q4_1, 1 row: 14 %;
/// Q8_0, 2 rows: 2.1×, 4 rows: 1.7×), so those keep one column. AVX2's 16 registers hold
/// one column of up to eight rows (two columns measured slower). Every shape does the same
/// arithmetic per column and row.
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
    let cols = out.len() / rows;
    for chunk_start in (0..rows).step_by(ROW_CHUNK) {
        let chunk = chunk_start..(chunk_start + ROW_CHUNK).min(rows);
        let mut c = 0;
        while c < cols {
            let (first, out) = (first_col + c, &mut out[c..]);
            c += match kernel {
                #[cfg(target_arch = "x86_64")]
                // SAFETY: `available` lists a SIMD kernel only where its features were detected.
                Kernel::Avx512Vnni => unsafe {
                    if cols - c >= 2 && chunk.len() >= TWO_COLUMN_MIN_ROWS {
                        column_tile!(
                            vnni::<C = 2, R = 4 | 2 | 1>,
                            weights, first, x, chunk, out, cols
                        )
                    } else {
                        column_tile!(
                            vnni::<C = 1, R = 8 | 4 | 2 | 1>,
                            weights, first, x, chunk, out, cols
                        )
                    }
                },
                #[cfg(target_arch = "x86_64")]
                // SAFETY: as above.
                Kernel::Avx2 => unsafe {
                    column_tile!(
                        avx2::<C = 1, R = 8 | 4 | 2 | 1>,
                        weights, first, x, chunk, out, cols
                    )
                },
                Kernel::Portable => {
                    let column = weights.column(first);
                    for row in chunk.clone() {
                        out[row * cols] = dot_portable(&column, x, row);
                    }
                    1
                }
            };
        }
    }
}

/// Σ_b scale_b · scale_x · (quants_b · row_b) + offset_b · scale_x · Σq_x, block by block.
fn dot_portable(column: &Column, x: &QuantizedRows, row: usize) -> f32 {
    let mut acc = 0f32;
    for &group in x.groups() {
        for j in 0..group.blocks {
            let (mut dot, mut sum) = (0i32, 0i32);
            for e in 0..BLOCK {
                let q = x.quant(row, group, j, e) as i32;
                dot += column.quant(group, group.position(j, e)) * q;
                sum += q;
            }
            let b = group.first_block + j;
            let scale_x = x.scale(row, b);
            acc += dot as f32 * (column.scales[b].to_f32() * scale_x);
            acc += column.offset(b) * (scale_x * sum as f32);
        }
    }
    acc
}
