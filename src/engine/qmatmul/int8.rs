//! Integer-dot kernels for Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K and Q6_K weights against
//! 8-bit activation rows (a K-quant superblock of 256 is 8 blocks of 32 with their own
//! scales; Q6_K's blocks have one per 16 elements). Each
//! weight block is decoded once per step and applied to a tile of rows, so a step over B rows
//! reads the weights once rather than B times. Every row keeps its own accumulators and the
//! same operation sequence whatever its tile, so results never depend on batch-mates.

use super::activations::{ActivationFormat, QuantizedRows};
use super::layout::{groups, stored_blocks, Group, BLOCK};
#[cfg(target_arch = "x86_64")]
use super::simd::{avx2, vnni};
use candle_core::quantized::GgmlDType;
use half::f16;
use std::ops::Range;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Int8Format {
    /// weight = d · q, q ∈ i8.
    Q8_0,
    /// weight = d · (n − 8), n ∈ 0..16.
    Q4_0,
    /// weight = d · n + m, n ∈ 0..16.
    Q4_1,
    /// weight = d · (n − 16), n ∈ 0..32: Q4_0's nibbles plus a plane of fifth bits.
    Q5_0,
    /// weight = d · n + m, n ∈ 0..32.
    Q5_1,
    /// Superblocks of 256: weight = d · sc · n − dmin · m, n ∈ 0..16, with a 6-bit sc and m
    /// per block of 32 and f16 d, dmin per superblock.
    Q4K,
    /// Q4_K with fifth bits, n ∈ 0..32.
    Q5K,
    /// Superblocks of 256: weight = d · sc · q, q ∈ −32..32, with an i8 sc per 16 elements
    /// and an f16 d per superblock; the quants are kept as signed bytes, like Q8_0's.
    Q6K,
}

impl Int8Format {
    pub fn of(dtype: GgmlDType) -> Option<Self> {
        match dtype {
            GgmlDType::Q8_0 => Some(Self::Q8_0),
            GgmlDType::Q4_0 => Some(Self::Q4_0),
            GgmlDType::Q4_1 => Some(Self::Q4_1),
            GgmlDType::Q5_0 => Some(Self::Q5_0),
            GgmlDType::Q5_1 => Some(Self::Q5_1),
            GgmlDType::Q4K => Some(Self::Q4K),
            GgmlDType::Q5K => Some(Self::Q5K),
            GgmlDType::Q6K => Some(Self::Q6K),
            _ => None,
        }
    }

    pub fn dtype(self) -> GgmlDType {
        match self {
            Self::Q8_0 => GgmlDType::Q8_0,
            Self::Q4_0 => GgmlDType::Q4_0,
            Self::Q4_1 => GgmlDType::Q4_1,
            Self::Q5_0 => GgmlDType::Q5_0,
            Self::Q5_1 => GgmlDType::Q5_1,
            Self::Q4K => GgmlDType::Q4K,
            Self::Q5K => GgmlDType::Q5K,
            Self::Q6K => GgmlDType::Q6K,
        }
    }

    /// Bytes per block in a GGUF file (a block of `file_block_elements`).
    pub fn file_block_bytes(self) -> usize {
        self.dtype().type_size()
    }

    /// Elements per block in a GGUF file: 32, or 256 for the K-quants' superblocks.
    pub fn file_block_elements(self) -> usize {
        self.dtype().block_size()
    }

    /// How activations are quantized against this format (ggml's `vec_dot_type`).
    pub fn activation_format(self) -> ActivationFormat {
        match self {
            Self::Q8_0 | Self::Q4_0 | Self::Q5_0 => ActivationFormat::Q8_0,
            Self::Q4_1 | Self::Q5_1 => ActivationFormat::Q8_1,
            Self::Q4K | Self::Q5K | Self::Q6K => ActivationFormat::Q8K,
        }
    }

    /// Whether a block's offset is stored (a minimum) rather than a multiple of its scale.
    pub fn has_min(self) -> bool {
        matches!(self, Self::Q4_1 | Self::Q5_1 | Self::Q4K | Self::Q5K)
    }

    /// Whether quants have a fifth bit beside their nibble.
    pub fn has_high_bits(self) -> bool {
        matches!(self, Self::Q5_0 | Self::Q5_1 | Self::Q5K)
    }

    /// Whether scales come per superblock of 8 blocks times a 6-bit factor per block.
    pub fn has_superblocks(self) -> bool {
        matches!(self, Self::Q4K | Self::Q5K)
    }

    /// Whether each half of a block (16 elements) has its own scale.
    pub fn has_split_scales(self) -> bool {
        self == Self::Q6K
    }

    /// Whether quants are signed bytes (the others are unsigned nibbles).
    pub fn has_signed_bytes(self) -> bool {
        matches!(self, Self::Q8_0 | Self::Q6K)
    }

    /// Quant bytes per block as packed: 32 signed bytes, or 16 bytes of two nibbles
    /// (ggml's order: element j in the low nibble of byte j, element j + 16 in its high
    /// nibble).
    pub fn quant_bytes(self) -> usize {
        match self {
            Self::Q8_0 | Self::Q6K => BLOCK,
            _ => BLOCK / 2,
        }
    }

    /// Calls `f(sub, quants, header)` for each block of 32 in one file block: its quants
    /// (Q8_0's as i8 bytes, the others unsigned with their fifth bit) and header.
    fn decode(self, block: &[u8], mut f: impl FnMut(usize, [u8; BLOCK], Header)) {
        let half = |i: usize| f16::from_le_bytes([block[i], block[i + 1]]);
        let nibbles = |qs: &[u8], e: usize| {
            if e < BLOCK / 2 {
                qs[e] & 0x0F
            } else {
                qs[e - BLOCK / 2] >> 4
            }
        };
        let fifth =
            |qh: &[u8], e: usize| (u32::from_le_bytes(qh.try_into().unwrap()) >> e & 1) as u8;
        match self {
            Self::Q8_0 => f(0, block[2..34].try_into().unwrap(), Header::block(half(0))),
            Self::Q4_0 => f(
                0,
                std::array::from_fn(|e| nibbles(&block[2..], e)),
                Header::block(half(0)),
            ),
            Self::Q4_1 => f(
                0,
                std::array::from_fn(|e| nibbles(&block[4..], e)),
                Header::with_min(half(0), half(2)),
            ),
            Self::Q5_0 => f(
                0,
                std::array::from_fn(|e| nibbles(&block[6..], e) | fifth(&block[2..6], e) << 4),
                Header::block(half(0)),
            ),
            Self::Q5_1 => f(
                0,
                std::array::from_fn(|e| nibbles(&block[8..], e) | fifth(&block[4..8], e) << 4),
                Header::with_min(half(0), half(2)),
            ),
            Self::Q4K | Self::Q5K => {
                // d, dmin, 12 bytes of 6-bit scales and minimums, Q5_K's 32 bytes of fifth
                // bits (bit 2p / 2p + 1 of byte l for element l of block 2p / 2p + 1), then
                // the nibbles: byte 32p + l holds element l of blocks 2p (low) and 2p + 1.
                let scales = &block[4..16];
                let (qh, qs) = match self {
                    Self::Q5K => (&block[16..48], &block[48..]),
                    _ => (&block[16..16], &block[16..]),
                };
                for sub in 0..8 {
                    let (sc, m) = if sub < 4 {
                        (scales[sub] & 63, scales[sub + 4] & 63)
                    } else {
                        (
                            scales[sub + 4] & 0x0F | (scales[sub - 4] >> 6) << 4,
                            scales[sub + 4] >> 4 | (scales[sub] >> 6) << 4,
                        )
                    };
                    let quants = std::array::from_fn(|e| {
                        let packed = qs[32 * (sub / 2) + e];
                        let nibble = if sub % 2 == 0 {
                            packed & 0x0F
                        } else {
                            packed >> 4
                        };
                        let high = qh.get(e).map_or(0, |h| h >> sub & 1);
                        nibble | high << 4
                    });
                    f(sub, quants, Header::sub(sc, m, half(0), half(2)));
                }
            }
            Self::Q6K => {
                // ql (128 bytes), qh (64), 16 i8 scales, d. Per half of 128 elements, byte l
                // of its 64 ql bytes and 32 qh bytes holds elements l, l + 32 (ql's low
                // nibbles; qh bits 0-1, 2-3), l + 64, l + 96 (high nibbles; bits 4-5, 6-7).
                let (ql, qh, scales) = (&block[..128], &block[128..192], &block[192..208]);
                let d = half(208);
                for sub in 0..8 {
                    let quants = std::array::from_fn(|e| {
                        let element = 32 * sub + e;
                        let (part, l) = (element / 128, element % 32);
                        let quarter = element % 128 / 32;
                        let low = ql[64 * part + 32 * (quarter % 2) + l];
                        let nibble = if quarter < 2 { low & 0x0F } else { low >> 4 };
                        let high = qh[32 * part + l] >> (2 * quarter) & 3;
                        ((nibble | high << 4) as i8 - 32) as u8
                    });
                    let (first, second) = (scales[2 * sub] as i8, scales[2 * sub + 1] as i8);
                    f(sub, quants, Header::Split { first, second, d });
                }
            }
        }
    }
}

/// One block's header as a file stores it.
#[derive(Clone, Copy)]
enum Header {
    /// An f16 scale and (Q4_1, Q5_1) minimum.
    Block { scale: f16, min: f16 },
    /// A K-quant block: its 6-bit factors and its superblock's.
    Sub { sc: u8, m: u8, d: f16, dmin: f16 },
    /// A Q6_K block: the factors of its two halves and its superblock's.
    Split { first: i8, second: i8, d: f16 },
}

impl Header {
    fn block(scale: f16) -> Self {
        Self::Block {
            scale,
            min: f16::ZERO,
        }
    }

    fn with_min(scale: f16, min: f16) -> Self {
        Self::Block { scale, min }
    }

    fn sub(sc: u8, m: u8, d: f16, dmin: f16) -> Self {
        Self::Sub { sc, m, d, dmin }
    }
}

/// Quant bytes in 32-byte aligned units, so SIMD loads never straddle cache lines.
#[derive(Clone, Copy)]
#[repr(C, align(32))]
struct Aligned([u8; 32]);

/// Block scales and offsets (weight = scale · q + offset), `[n_out, stored_blocks]` plus
/// `HEADER_PADDING` values, so a column's headers convert to f32 in a few vector
/// instructions.
enum Headers {
    /// f16 per block: the scale and, where the format stores one, the minimum (the offset).
    Half { scales: Vec<f16>, mins: Vec<f16> },
    /// K-quants: 6-bit factors per block, f16 ones per superblock of 8 blocks
    /// (`[n_out, stored_blocks / 8]`): scale = d · sc, offset = −dmin · m, both exact in f32.
    Super {
        sc: Vec<u8>,
        m: Vec<u8>,
        d: Vec<f16>,
        dmin: Vec<f16>,
    },
    /// Q6_K: an i8 factor per half block (`halves[h]` for elements 16h..16h + 16, stored
    /// as bytes), an f16 d per superblock: scale = d · sc, no offset.
    Split { halves: [Vec<u8>; 2], d: Vec<f16> },
}

/// A `[n_out, k_in]` matrix repacked from ggml's interleaved blocks into separate arrays:
/// each output column's quants in the grouped layout of `layout` (nibbles paired so one load
/// unpacks two vectors), headers contiguous beside them; fifth bits in a plane of their own,
/// one bit per grouped-layout position (bit `p % 8` of byte `p / 8` of the group's
/// `4 · blocks` bytes), so a vector's 64 bits are one mask. Columns with an odd block count
/// get a zero block (scale 0), so every group is whole.
pub struct PackedInt8 {
    format: Int8Format,
    blocks_per_row: usize,
    groups: Vec<Group>,
    quants: Vec<Aligned>,
    headers: Headers,
    /// Fifth bits, `stored_blocks · 4` bytes per column; empty for the formats without.
    high: Vec<u8>,
}

impl PackedInt8 {
    /// `bytes` holds the `[n_out, k_in]` matrix's file blocks in ggml's layout; a row has
    /// `blocks_per_row` blocks of 32.
    pub fn from_ggml(format: Int8Format, bytes: &[u8], blocks_per_row: usize) -> Self {
        let subs = format.file_block_elements() / BLOCK;
        let file_blocks_per_row = (blocks_per_row / subs).max(1);
        let columns = bytes.len() / format.file_block_bytes() / file_blocks_per_row;
        let stored = stored_blocks(blocks_per_row);
        let groups = groups(blocks_per_row);
        let quant_bytes = format.quant_bytes();
        let column_bytes = stored * quant_bytes;
        let mut quants = vec![Aligned([0; 32]); (columns * column_bytes).div_ceil(32)];
        let flat = bytes_mut(&mut quants);
        let count = columns * stored + HEADER_PADDING;
        let supers = columns * stored / 8 + HEADER_PADDING;
        let mut headers = if format.has_split_scales() {
            Headers::Split {
                halves: [vec![0; count], vec![0; count]],
                d: vec![f16::ZERO; supers],
            }
        } else if format.has_superblocks() {
            Headers::Super {
                sc: vec![0; count],
                m: vec![0; count],
                d: vec![f16::ZERO; supers],
                dmin: vec![f16::ZERO; supers],
            }
        } else {
            let mins = if format.has_min() { count } else { 0 };
            Headers::Half {
                scales: vec![f16::ZERO; count],
                mins: vec![f16::ZERO; mins],
            }
        };
        let high_bytes = stored * BLOCK / 8;
        let mut high = vec![
            0u8;
            if format.has_high_bits() {
                columns * high_bytes
            } else {
                0
            }
        ];
        for (fb, block) in bytes.chunks_exact(format.file_block_bytes()).enumerate() {
            format.decode(block, |sub, q, header| {
                let b = fb * subs + sub;
                let (col, block_index) = (b / blocks_per_row, b % blocks_per_row);
                let at = col * stored + block_index;
                match (&mut headers, header) {
                    (Headers::Half { scales, mins }, Header::Block { scale, min }) => {
                        scales[at] = scale;
                        if let Some(slot) = mins.get_mut(at) {
                            *slot = min;
                        }
                    }
                    (
                        Headers::Super { sc, m, d, dmin },
                        Header::Sub {
                            sc: s,
                            m: n,
                            d: e,
                            dmin: f,
                        },
                    ) => {
                        (sc[at], m[at], d[at / 8], dmin[at / 8]) = (s, n, e, f);
                    }
                    (
                        Headers::Split { halves, d },
                        Header::Split {
                            first,
                            second,
                            d: e,
                        },
                    ) => {
                        (halves[0][at], halves[1][at], d[at / 8]) = (first as u8, second as u8, e);
                    }
                    _ => unreachable!("a format decodes to its own header kind"),
                }
                let group = group_of(&groups, block_index);
                let column = &mut flat[col * column_bytes..(col + 1) * column_bytes];
                let group_bytes = &mut column[group.first_block * quant_bytes..];
                // Four consecutive elements sit at four consecutive positions.
                for element in (0..BLOCK).step_by(4) {
                    let first = group.position(block_index - group.first_block, element);
                    for (e, position) in (element..element + 4).zip(first..) {
                        if format.has_signed_bytes() {
                            group_bytes[position] = q[e];
                            continue;
                        }
                        let (byte, high_nibble) = group.nibble_slot(position);
                        let nibble = q[e] & 0x0F;
                        group_bytes[byte] |= if high_nibble { nibble << 4 } else { nibble };
                        if q[e] >> 4 & 1 == 1 {
                            let at =
                                col * high_bytes + group.first_block * BLOCK / 8 + position / 8;
                            high[at] |= 1 << (position % 8);
                        }
                    }
                }
            });
        }
        Self {
            format,
            blocks_per_row,
            groups,
            quants,
            headers,
            high,
        }
    }

    pub fn format(&self) -> Int8Format {
        self.format
    }

    /// Bytes of quants, headers and fifth bits (what a pass over every column reads).
    pub fn stored_bytes(&self) -> usize {
        let headers = match &self.headers {
            Headers::Half { scales, mins } => (scales.len() + mins.len()) * 2,
            Headers::Super { sc, m, d, dmin } => sc.len() + m.len() + (d.len() + dmin.len()) * 2,
            Headers::Split { halves, d } => halves[0].len() * 2 + d.len() * 2,
        };
        self.quants.len() * 32 + headers + self.high.len()
    }

    pub fn columns(&self) -> usize {
        let count = match &self.headers {
            Headers::Half { scales, .. } => scales.len(),
            Headers::Super { sc, .. } => sc.len(),
            Headers::Split { halves, .. } => halves[0].len(),
        };
        (count - HEADER_PADDING) / stored_blocks(self.blocks_per_row).max(1)
    }

    /// Output column `col` as the kernels read it. Inlined so the tiles' callers build their
    /// column arrays in place: called out of line, each ~100-byte view was written field by
    /// field and copied again with wide loads, which made a B = 8 decode step ~20 % slower.
    #[inline(always)]
    pub fn column(&self, col: usize) -> Column<'_> {
        let stored = stored_blocks(self.blocks_per_row);
        let len = stored * self.format.quant_bytes();
        let high_len = stored * BLOCK / 8;
        let at = col * stored;
        Column {
            format: self.format,
            quants: &bytes(&self.quants)[col * len..(col + 1) * len],
            headers: match &self.headers {
                Headers::Half { scales, mins } => ColumnHeaders::Half {
                    scales: &scales[at..],
                    mins: mins.get(at..).unwrap_or(&[]),
                },
                Headers::Super { sc, m, d, dmin } => ColumnHeaders::Super {
                    sc: &sc[at..],
                    m: &m[at..],
                    d: &d[at / 8..],
                    dmin: &dmin[at / 8..],
                },
                Headers::Split { halves, d } => ColumnHeaders::Split {
                    halves: [&halves[0][at..], &halves[1][at..]],
                    d: &d[at / 8..],
                },
            },
            high: self
                .high
                .get(col * high_len..(col + 1) * high_len)
                .unwrap_or(&[]),
        }
    }

    /// Calls `f(column, block, quants)` for every block in order, with its 32 quants unpacked
    /// (signed bytes for Q8_0, nibbles with their fifth bit for the others).
    fn for_each_block(&self, mut f: impl FnMut(&Column, usize, [i32; BLOCK])) {
        for col in 0..self.columns() {
            let column = self.column(col);
            for block in 0..self.blocks_per_row {
                let group = group_of(&self.groups, block);
                let j = block - group.first_block;
                f(
                    &column,
                    block,
                    std::array::from_fn(|e| column.quant(group, group.position(j, e))),
                );
            }
        }
    }

    /// Every block's quant bytes in ggml's order for blocks of 32 (nibble formats: element
    /// j's low four bits in the low nibble of byte j, element j + 16's in its high nibble),
    /// column after column: `[n_out, blocks_per_row, quant_bytes]`.
    pub fn block_quants(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(self.columns() * self.blocks_per_row * BLOCK);
        self.for_each_block(|_, _, q| match self.format.has_signed_bytes() {
            true => out.extend(q.map(|v| v as u8)),
            false => out.extend(
                (0..BLOCK / 2).map(|e| (q[e] & 0x0F | (q[e + BLOCK / 2] & 0x0F) << 4) as u8),
            ),
        });
        out
    }

    /// Fifth bits in the order of ggml's blocks of 32 (bit j of a block's u32 for element
    /// j), `[n_out, blocks_per_row]`; empty for the formats without.
    pub fn block_high_bits(&self) -> Vec<u32> {
        let mut out = Vec::new();
        if self.format.has_high_bits() {
            self.for_each_block(|_, _, q| {
                out.push((0..BLOCK).map(|e| ((q[e] >> 4) as u32 & 1) << e).sum())
            });
        }
        out
    }

    /// Every block's scale and offset as f32, `[n_out, blocks_per_row]` each (weight =
    /// scale · q + offset; offsets are zero for Q8_0); Q6_K's blocks have two scales, so it
    /// has none to give (`half_block_scales`).
    pub fn scales_and_offsets(&self) -> (Vec<f32>, Vec<f32>) {
        assert!(
            !self.format.has_split_scales(),
            "Q6_K has a scale per half block"
        );
        self.per_block(|column, block| (column.scale(block), column.offset(block)))
            .into_iter()
            .unzip()
    }

    /// Every block's scales of its first and second 16 elements as f32, `[n_out,
    /// blocks_per_row]` each: Q6_K's weight = scale of its half · q (the others' halves share
    /// one scale).
    pub fn half_block_scales(&self) -> [Vec<f32>; 2] {
        let (first, second) = self
            .per_block(|column, block| {
                (
                    column.element_scale(block, 0),
                    column.element_scale(block, BLOCK / 2),
                )
            })
            .into_iter()
            .unzip();
        [first, second]
    }

    /// `f(column, block)` for every block, column after column: `[n_out, blocks_per_row]`.
    fn per_block<T>(&self, f: impl Fn(&Column, usize) -> T) -> Vec<T> {
        let f = &f;
        (0..self.columns())
            .flat_map(|col| {
                let column = self.column(col);
                (0..self.blocks_per_row).map(move |block| f(&column, block))
            })
            .collect()
    }

    /// The weights as f32, row-major `[n_out, k_in]`.
    pub fn dequantize(&self) -> Vec<f32> {
        let mut out = Vec::with_capacity(self.columns() * self.blocks_per_row * BLOCK);
        self.for_each_block(|column, block, q| {
            let offset = column.offset(block);
            out.extend((0..BLOCK).map(|e| column.element_scale(block, e) * q[e] as f32 + offset));
        });
        out
    }
}

/// Header values past the last column, so kernels may read a whole register of them (16
/// block values, or 16 superblock values) from any group.
const HEADER_PADDING: usize = 16;

/// The group that holds block `block`.
fn group_of(groups: &[Group], block: usize) -> Group {
    *groups
        .iter()
        .find(|g| block < g.first_block + g.blocks)
        .expect("the block lies inside the row")
}

/// One column's headers from its first block on; at least `HEADER_PADDING` values past its
/// last block (or superblock) are readable (the next column's, or zeros).
#[derive(Clone, Copy)]
pub enum ColumnHeaders<'a> {
    Half {
        scales: &'a [f16],
        /// Empty for the formats whose offset is a multiple of the scale.
        mins: &'a [f16],
    },
    Super {
        sc: &'a [u8],
        m: &'a [u8],
        d: &'a [f16],
        dmin: &'a [f16],
    },
    /// Q6_K: i8 factors (as bytes) of each block's first and second half.
    Split { halves: [&'a [u8]; 2], d: &'a [f16] },
}

/// One output column: what every kernel reads.
pub struct Column<'a> {
    pub format: Int8Format,
    /// Quant bytes in the grouped layout (Q8_0 signed, the others nibbles).
    pub quants: &'a [u8],
    pub headers: ColumnHeaders<'a>,
    /// Fifth bits (see `PackedInt8`), `stored_blocks · 4` bytes; empty for formats without.
    pub high: &'a [u8],
}

impl Column<'_> {
    /// Block `block`'s scale: weight = scale · q + offset (the first half's for Q6_K).
    pub fn scale(&self, block: usize) -> f32 {
        self.element_scale(block, 0)
    }

    /// The scale of element `element` of block `block`.
    pub fn element_scale(&self, block: usize, element: usize) -> f32 {
        match self.headers {
            ColumnHeaders::Half { scales, .. } => scales[block].to_f32(),
            ColumnHeaders::Super { sc, d, .. } => d[block / 8].to_f32() * sc[block] as f32,
            ColumnHeaders::Split { halves, d } => {
                d[block / 8].to_f32() * halves[element / (BLOCK / 2)][block] as i8 as f32
            }
        }
    }

    /// Block `block`'s offset: weight = scale · q + offset.
    pub fn offset(&self, block: usize) -> f32 {
        match (self.format, self.headers) {
            (Int8Format::Q8_0 | Int8Format::Q6K, _) => 0.0,
            (Int8Format::Q4_0, _) => -8.0 * self.scale(block),
            (Int8Format::Q5_0, _) => -16.0 * self.scale(block),
            (_, ColumnHeaders::Half { mins, .. }) => mins[block].to_f32(),
            (_, ColumnHeaders::Super { m, dmin, .. }) => {
                -(dmin[block / 8].to_f32() * m[block] as f32)
            }
            (_, ColumnHeaders::Split { .. }) => 0.0,
        }
    }

    /// The quant at `position` of group `group`'s unpacked bytes.
    fn quant(&self, group: Group, position: usize) -> i32 {
        if self.format.has_signed_bytes() {
            return self.quants[group.first_block * BLOCK + position] as i8 as i32;
        }
        let (byte, high) = group.nibble_slot(position);
        let packed = self.quants[group.first_block * BLOCK / 2 + byte];
        let nibble = if high { packed >> 4 } else { packed & 0x0F };
        let fifth = match self.format.has_high_bits() {
            true => self.high[group.first_block * BLOCK / 8 + position / 8] >> (position % 8) & 1,
            false => 0,
        };
        (nibble | fifth << 4) as i32
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
/// registers). `out` holds the rows `[rows, stride]` from row `rows.start` and column `first`.
macro_rules! column_tile {
    (
        $module:ident::<C = $c:literal, R = $($r:literal)|+>,
        $weights:expr, $first:expr, $x:expr, $rows:expr, $out:expr, $stride:expr
    ) => {{
        let columns: [Column; $c] = std::array::from_fn(|i| $weights.column($first + i));
        let mut row = $rows.start;
        while row < $rows.end {
            let (remaining, out) = ($rows.end - row, &mut $out[(row - $rows.start) * $stride..]);
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

/// Rows a chunk needs before the VNNI kernel unpacks nibble columns once for all its row
/// tiles (`unpacked_column_pair`).
const UNPACK_MIN_ROWS: usize = 32;

/// Activation rows handled per pass over a column range (here and in the dense kernels): they
/// stay in L1/L2 while the columns' weights stream past.
pub(super) const ROW_CHUNK: usize = 64;

/// Dot products of weight rows (output columns) `first_col..` with activation rows `rows`,
/// into `out` laid out `[rows, columns]`.
///
/// Tile shapes, measured on Zen 4 (1 thread, SmolLM2-sized matrices, 30 layers' worth so the
/// weights stream from memory): with VNNI and 8 or more rows, two columns of up to four rows
/// share each activation load (B = 8: 400 → 376 µs a layer from cache; 64 rows 26 % faster
/// than one column of eight rows; 2 · 4 accumulators and 2 · 4 dot vectors fit the 32
/// registers, 2 · 8 would spill). With fewer rows each column pair gets a single pass, and
/// two interleaved columns streaming from memory ran slower than one (Q4_1, 1 row: 14 %;
/// Q8_0, 2 rows: 2.1×, 4 rows: 1.7×), so those keep one column. AVX2's 16 registers hold
/// one column of up to eight rows (two columns measured slower). Every row count up to a tile's
/// largest has a tile of its own: a count split into power-of-two tiles paid each tile's
/// weight unpacking again (CPU pair, 1 thread: the Q4_1 LLM's 7-row step 22.3 ms against
/// 12.3 with its own tile and 13.7 at 8 rows). Every shape does the same arithmetic per column
/// and row.
pub fn columns(
    kernel: Kernel,
    weights: &PackedInt8,
    x: &QuantizedRows,
    rows: Range<usize>,
    first_col: usize,
    out: &mut [f32],
) {
    if rows.is_empty() {
        return;
    }
    assert!(rows.end <= x.rows(), "activation rows out of range");
    let cols = out.len() / rows.len();
    // Two unpacked nibble columns (`unpacked_column_pair`), made on first use.
    #[cfg(target_arch = "x86_64")]
    let mut unpacked: Option<Vec<Line>> = None;
    for chunk_start in rows.clone().step_by(ROW_CHUNK) {
        let chunk = chunk_start..(chunk_start + ROW_CHUNK).min(rows.end);
        let mut c = 0;
        while c < cols {
            // `out` from the chunk's first row, so the tiles index it by rows of `x`.
            let out = &mut out[(chunk_start - rows.start) * cols + c..];
            let first = first_col + c;
            c += match kernel {
                #[cfg(target_arch = "x86_64")]
                // SAFETY: `available` lists a SIMD kernel only where its features were detected.
                Kernel::Avx512Vnni => unsafe {
                    let two_columns = cols - c >= 2 && chunk.len() >= TWO_COLUMN_MIN_ROWS;
                    let unpack = chunk.len() >= UNPACK_MIN_ROWS;
                    if two_columns && unpack && !weights.format.has_signed_bytes() {
                        let scratch = unpacked.get_or_insert_with(|| {
                            vec![Line([0; 64]); x.stored_blocks() * 32 / 64 * 2]
                        });
                        unpacked_column_pair(weights, first, x, chunk.clone(), out, cols, scratch)
                    } else if two_columns {
                        column_tile!(
                            vnni::<C = 2, R = 4 | 3 | 2 | 1>,
                            weights, first, x, chunk, out, cols
                        )
                    } else {
                        column_tile!(
                            vnni::<C = 1, R = 8 | 7 | 6 | 5 | 4 | 3 | 2 | 1>,
                            weights, first, x, chunk, out, cols
                        )
                    }
                },
                #[cfg(target_arch = "x86_64")]
                // SAFETY: as above.
                Kernel::Avx2 => unsafe {
                    column_tile!(
                        avx2::<C = 1, R = 8 | 7 | 6 | 5 | 4 | 3 | 2 | 1>,
                        weights, first, x, chunk, out, cols
                    )
                },
                Kernel::Portable => {
                    let column = weights.column(first);
                    for row in chunk.clone() {
                        out[(row - chunk_start) * cols] = dot_portable(&column, x, row);
                    }
                    1
                }
            };
        }
    }
}

/// 64 bytes, aligned for whole-vector loads and stores.
#[cfg(target_arch = "x86_64")]
#[derive(Clone, Copy)]
#[repr(C, align(64))]
struct Line([u8; 64]);

/// Columns `first` and `first + 1` of a nibble format against `rows`, unpacked into
/// `scratch` once (`vnni::unpack_nibbles`) instead of once per row tile as `vnni::tile`
/// does: a prefill chunk's 64 rows are 16 row tiles, and unpacking was a third of the
/// instructions per product. Same sums, same results. Returns the columns done (2).
///
/// # Safety
/// The CPU has AVX-512 VNNI (`Kernel::Avx512Vnni`).
#[cfg(target_arch = "x86_64")]
unsafe fn unpacked_column_pair(
    weights: &PackedInt8,
    first: usize,
    x: &QuantizedRows,
    rows: Range<usize>,
    out: &mut [f32],
    stride: usize,
    scratch: &mut [Line],
) -> usize {
    let columns: [Column; 2] = std::array::from_fn(|i| weights.column(first + i));
    let (a, b) = scratch.split_at_mut(scratch.len() / 2);
    let [a, b] = [a, b].map(|lines| {
        // SAFETY: `Line` is `repr(C)` over `[u8; 64]` with no padding.
        unsafe { std::slice::from_raw_parts_mut(lines.as_mut_ptr().cast::<u8>(), lines.len() * 64) }
    });
    vnni::unpack_nibbles(&columns[0], x, a);
    vnni::unpack_nibbles(&columns[1], x, b);
    let unpacked = [&*a, &*b];
    let mut row = rows.start;
    while row < rows.end {
        let out = &mut out[(row - rows.start) * stride..];
        row += match rows.end - row {
            4.. => {
                vnni::unpacked_tile::<4, 2>(&columns, unpacked, x, row, out, stride);
                4
            }
            3 => {
                vnni::unpacked_tile::<3, 2>(&columns, unpacked, x, row, out, stride);
                3
            }
            2 => {
                vnni::unpacked_tile::<2, 2>(&columns, unpacked, x, row, out, stride);
                2
            }
            _ => {
                vnni::unpacked_tile::<1, 2>(&columns, unpacked, x, row, out, stride);
                1
            }
        };
    }
    2
}

/// Σ_b scale_b · scale_x · (quants_b · row_b) + offset_b · (the row block's sum), block by
/// block.
fn dot_portable(column: &Column, x: &QuantizedRows, row: usize) -> f32 {
    let mut acc = 0f32;
    for &group in x.groups() {
        for j in 0..group.blocks {
            let b = group.first_block + j;
            let scale_x = x.scale(row, b);
            if column.format.has_split_scales() {
                for half in 0..2 {
                    let dot: i32 = (half * BLOCK / 2..(half + 1) * BLOCK / 2)
                        .map(|e| {
                            let q = x.quant(row, group, j, e) as i32;
                            column.quant(group, group.position(j, e)) * q
                        })
                        .sum();
                    acc += dot as f32 * (column.element_scale(b, half * BLOCK / 2) * scale_x);
                }
                continue;
            }
            let dot: i32 = (0..BLOCK)
                .map(|e| {
                    column.quant(group, group.position(j, e)) * x.quant(row, group, j, e) as i32
                })
                .sum();
            acc += dot as f32 * (column.scale(b) * scale_x);
            acc += column.offset(b) * x.block_sum(row, b);
        }
    }
    acc
}
