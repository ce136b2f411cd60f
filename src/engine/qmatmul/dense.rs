//! Dense weight matrices (f32, f16, bf16) and their batched matmul. Weights stay in their
//! stored width and are widened to f32 in registers, so a 16-bit matrix reads half the bytes
//! of f32 (decode at B = 1 is bound by reading the weights) and computes what the f32 matrix
//! of the same values computes: activations stay f32, products and sums are f32.
//! A tile multiplies `C` columns by `R` rows: each weight vector is loaded and widened once for
//! all its rows. Every (row, column) keeps one vector accumulator over the whole row, reduced
//! in one fixed order, so a row's result never depends on its tile (batched == unbatched).

use super::int8::{Kernel, ROW_CHUNK};
use candle_core::quantized::GgmlDType;
use half::{bf16, f16};

/// A row-major `[n_out, k_in]` matrix at its stored precision.
pub enum DenseMatrix {
    F32(Vec<f32>),
    F16(Vec<f16>),
    Bf16(Vec<bf16>),
}

/// Runs `$body` with `$v` bound to the typed value vector, whatever its precision.
macro_rules! with_values {
    ($matrix:expr, $v:ident => $body:expr) => {
        match $matrix {
            DenseMatrix::F32($v) => $body,
            DenseMatrix::F16($v) => $body,
            DenseMatrix::Bf16($v) => $body,
        }
    };
}

impl DenseMatrix {
    pub fn dtype(&self) -> GgmlDType {
        match self {
            Self::F32(_) => GgmlDType::F32,
            Self::F16(_) => GgmlDType::F16,
            Self::Bf16(_) => GgmlDType::BF16,
        }
    }

    pub fn stored_bytes(&self) -> usize {
        with_values!(self, v => std::mem::size_of_val(v.as_slice()))
    }

    pub fn to_f32(&self) -> Vec<f32> {
        with_values!(self, v => v.iter().map(|&e| e.widen()).collect())
    }
}

/// A stored value that widens to f32 exactly.
pub(super) trait Element: Copy + Sync {
    fn widen(self) -> f32;
}

impl Element for f32 {
    fn widen(self) -> f32 {
        self
    }
}

impl Element for f16 {
    fn widen(self) -> f32 {
        self.to_f32()
    }
}

impl Element for bf16 {
    fn widen(self) -> f32 {
        self.to_f32()
    }
}

/// Columns per tile: four weight streams share each activation load. With four rows the
/// AVX-512 tile holds 16 accumulators, 4 activation vectors and a weight vector in its 32
/// registers; AVX2's 16 registers take two columns of four rows.
const COLUMNS: usize = 4;

/// Dot products of the matrix's rows (output columns) `first_col..` with every row of `x`
/// (`[rows, k_in]`), into `out` laid out `[rows, columns]`.
pub fn columns(
    kernel: Kernel,
    matrix: &DenseMatrix,
    k_in: usize,
    x: &[f32],
    first_col: usize,
    out: &mut [f32],
) {
    with_values!(matrix, w => columns_of(kernel, w, k_in, x, first_col, out))
}

fn columns_of<T: Element + Wide>(
    kernel: Kernel,
    weights: &[T],
    k_in: usize,
    x: &[f32],
    first_col: usize,
    out: &mut [f32],
) {
    let rows = x.len() / k_in.max(1);
    if rows == 0 {
        return;
    }
    let cols = out.len() / rows;
    assert!(
        weights.len() >= (first_col + cols) * k_in && x.len() == rows * k_in,
        "dense matmul operands have the wrong length"
    );
    let tiles = Tiles {
        weights,
        k_in,
        x,
        stride: cols,
    };
    for chunk_start in (0..rows).step_by(ROW_CHUNK) {
        let chunk_end = (chunk_start + ROW_CHUNK).min(rows);
        let mut c = 0;
        while c < cols {
            c += match kernel {
                #[cfg(target_arch = "x86_64")]
                // SAFETY: `Kernel::available` lists a SIMD kernel only where its features
                // (AVX-512F; AVX2, FMA and F16C) were detected.
                Kernel::Avx512Vnni => unsafe {
                    tiles.run::<COLUMNS>(first_col, c, chunk_start..chunk_end, out, x86::tile512)
                },
                #[cfg(target_arch = "x86_64")]
                // SAFETY: as above.
                Kernel::Avx2 => unsafe {
                    tiles.run::<2>(first_col, c, chunk_start..chunk_end, out, x86::tile256)
                },
                Kernel::Portable => {
                    let w = &weights[(first_col + c) * k_in..(first_col + c + 1) * k_in];
                    for row in chunk_start..chunk_end {
                        out[row * cols + c] = dot_portable(w, &x[row * k_in..(row + 1) * k_in]);
                    }
                    1
                }
            };
        }
    }
}

/// The operands of one `columns` call, cut into tiles.
struct Tiles<'a, T> {
    weights: &'a [T],
    k_in: usize,
    x: &'a [f32],
    /// Columns per output row.
    stride: usize,
}

/// A SIMD tile: `cols` columns from `first` against `rows` rows from `row`, written to
/// `out[r · stride + c]` (`out` starting at the tile's first column of its first row);
/// `None` for a shape it has no code for.
#[cfg(target_arch = "x86_64")]
type Tile<T> = unsafe fn(&Tiles<T>, usize, usize, &mut [f32], usize, usize) -> Option<()>;

impl<T: Element + Wide> Tiles<'_, T> {
    /// Runs the tile shapes over `rows` for up to `C` columns from column `c`; returns the
    /// columns done. Row tiles are 4, 2 and 1 rows (constants: accumulators stay in registers).
    ///
    /// # Safety
    /// The CPU has the features `tile` was compiled for.
    #[cfg(target_arch = "x86_64")]
    unsafe fn run<const C: usize>(
        &self,
        first_col: usize,
        c: usize,
        rows: std::ops::Range<usize>,
        out: &mut [f32],
        tile: Tile<T>,
    ) -> usize {
        let width = C.min(self.stride - c);
        let mut row = rows.start;
        while row < rows.end {
            let tile_rows = match rows.end - row {
                4.. => 4,
                2 | 3 => 2,
                _ => 1,
            };
            tile(
                self,
                first_col + c,
                row,
                &mut out[row * self.stride + c..],
                tile_rows,
                width,
            )
            .expect("tile shapes cover 1, 2 and 4 rows and 1 to 4 columns");
            row += tile_rows;
        }
        width
    }

    /// The scalar dot of the elements past the last full vector of `lanes`.
    fn tail(&self, column: usize, row: usize, lanes: usize) -> f32 {
        let w = &self.weights[column * self.k_in..(column + 1) * self.k_in];
        let x = &self.x[row * self.k_in..(row + 1) * self.k_in];
        (lanes..self.k_in).map(|i| x[i] * w[i].widen()).sum()
    }
}

/// 16 lanes summed in a fixed tree, then the tail: the SIMD kernels' arithmetic up to fused
/// multiply-adds and the order of their final reduction.
fn dot_portable<T: Element>(w: &[T], x: &[f32]) -> f32 {
    const LANES: usize = 16;
    let full = w.len() / LANES * LANES;
    let mut acc = [0f32; LANES];
    for (wc, xc) in w[..full]
        .chunks_exact(LANES)
        .zip(x[..full].chunks_exact(LANES))
    {
        for l in 0..LANES {
            acc[l] += xc[l] * wc[l].widen();
        }
    }
    let mut width = LANES;
    while width > 1 {
        width /= 2;
        for l in 0..width {
            acc[l] += acc[l + width];
        }
    }
    acc[0] + (full..w.len()).map(|i| x[i] * w[i].widen()).sum::<f32>()
}

#[cfg(not(target_arch = "x86_64"))]
pub(super) trait Wide {}
#[cfg(not(target_arch = "x86_64"))]
impl<T> Wide for T {}

#[cfg(target_arch = "x86_64")]
pub(super) use x86::Wide;

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::super::simd::{horizontal_sum, prefetch};
    use super::{Element, Tiles};
    use half::{bf16, f16};
    use std::arch::x86_64::*;

    /// Loading `N` stored values widened to f32 lanes.
    pub trait Wide: Sized {
        /// # Safety
        /// AVX-512F is present and `p` points at 16 readable values.
        unsafe fn load16(p: *const Self) -> __m512;
        /// # Safety
        /// AVX2 and F16C are present and `p` points at 8 readable values.
        unsafe fn load8(p: *const Self) -> __m256;
    }

    impl Wide for f32 {
        #[inline]
        #[target_feature(enable = "avx512f")]
        unsafe fn load16(p: *const Self) -> __m512 {
            _mm512_loadu_ps(p)
        }
        #[inline]
        #[target_feature(enable = "avx2")]
        unsafe fn load8(p: *const Self) -> __m256 {
            _mm256_loadu_ps(p)
        }
    }

    impl Wide for f16 {
        #[inline]
        #[target_feature(enable = "avx512f")]
        unsafe fn load16(p: *const Self) -> __m512 {
            _mm512_cvtph_ps(_mm256_loadu_si256(p as *const __m256i))
        }
        #[inline]
        #[target_feature(enable = "avx2,f16c")]
        unsafe fn load8(p: *const Self) -> __m256 {
            _mm256_cvtph_ps(_mm_loadu_si128(p as *const __m128i))
        }
    }

    /// bf16 is the high half of an f32: widening is a shift.
    impl Wide for bf16 {
        #[inline]
        #[target_feature(enable = "avx512f")]
        unsafe fn load16(p: *const Self) -> __m512 {
            let halves = _mm512_cvtepu16_epi32(_mm256_loadu_si256(p as *const __m256i));
            _mm512_castsi512_ps(_mm512_slli_epi32::<16>(halves))
        }
        #[inline]
        #[target_feature(enable = "avx2")]
        unsafe fn load8(p: *const Self) -> __m256 {
            let halves = _mm256_cvtepu16_epi32(_mm_loadu_si128(p as *const __m128i));
            _mm256_castsi256_ps(_mm256_slli_epi32::<16>(halves))
        }
    }

    /// Dispatches a run-time tile shape to its constant-size tile; `None` for a shape outside
    /// `rows ∈ {1, 2, 4}` and the listed column counts.
    macro_rules! shapes {
        ($tile:ident, $tiles:expr, $first:expr, $row:expr, $out:expr, $rows:expr, $cols:expr,
         [$($c:literal),+]) => {
            match ($rows, $cols) {
                $((4, $c) => Some($tile::<T, 4, $c>($tiles, $first, $row, $out)),
                  (2, $c) => Some($tile::<T, 2, $c>($tiles, $first, $row, $out)),
                  (1, $c) => Some($tile::<T, 1, $c>($tiles, $first, $row, $out)),)+
                _ => None,
            }
        };
    }

    /// # Safety
    /// AVX-512F is present.
    pub unsafe fn tile512<T: Element + Wide>(
        tiles: &Tiles<T>,
        first: usize,
        row: usize,
        out: &mut [f32],
        rows: usize,
        cols: usize,
    ) -> Option<()> {
        shapes!(fma512, tiles, first, row, out, rows, cols, [1, 2, 3, 4])
    }

    /// # Safety
    /// AVX2, FMA and F16C are present.
    pub unsafe fn tile256<T: Element + Wide>(
        tiles: &Tiles<T>,
        first: usize,
        row: usize,
        out: &mut [f32],
        rows: usize,
        cols: usize,
    ) -> Option<()> {
        shapes!(fma256, tiles, first, row, out, rows, cols, [1, 2])
    }

    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn fma512<T: Element + Wide, const R: usize, const C: usize>(
        tiles: &Tiles<T>,
        first: usize,
        row: usize,
        out: &mut [f32],
    ) {
        let k = tiles.k_in;
        let lanes = k / 16 * 16;
        let w: [*const T; C] = std::array::from_fn(|c| tiles.weights[(first + c) * k..].as_ptr());
        let x: [*const f32; R] = std::array::from_fn(|r| tiles.x[(row + r) * k..].as_ptr());
        let mut acc = [[_mm512_setzero_ps(); R]; C];
        let mut i = 0;
        while i < lanes {
            prefetch_ahead::<T, C>(tiles, first, i / 16, 16);
            let xv: [__m512; R] = std::array::from_fn(|r| _mm512_loadu_ps(x[r].add(i)));
            for c in 0..C {
                let wv = T::load16(w[c].add(i));
                for r in 0..R {
                    acc[c][r] = _mm512_fmadd_ps(xv[r], wv, acc[c][r]);
                }
            }
            i += 16;
        }
        for c in 0..C {
            for r in 0..R {
                out[r * tiles.stride + c] =
                    _mm512_reduce_add_ps(acc[c][r]) + tiles.tail(first + c, row + r, lanes);
            }
        }
    }

    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn fma256<T: Element + Wide, const R: usize, const C: usize>(
        tiles: &Tiles<T>,
        first: usize,
        row: usize,
        out: &mut [f32],
    ) {
        let k = tiles.k_in;
        let lanes = k / 8 * 8;
        let w: [*const T; C] = std::array::from_fn(|c| tiles.weights[(first + c) * k..].as_ptr());
        let x: [*const f32; R] = std::array::from_fn(|r| tiles.x[(row + r) * k..].as_ptr());
        let mut acc = [[_mm256_setzero_ps(); R]; C];
        let mut i = 0;
        while i < lanes {
            prefetch_ahead::<T, C>(tiles, first, i / 8, 8);
            let xv: [__m256; R] = std::array::from_fn(|r| _mm256_loadu_ps(x[r].add(i)));
            for c in 0..C {
                let wv = T::load8(w[c].add(i));
                for r in 0..R {
                    acc[c][r] = _mm256_fmadd_ps(xv[r], wv, acc[c][r]);
                }
            }
            i += 8;
        }
        for c in 0..C {
            for r in 0..R {
                out[r * tiles.stride + c] =
                    horizontal_sum(acc[c][r]) + tiles.tail(first + c, row + r, lanes);
            }
        }
    }

    /// Asks for the bytes pass `pass` (of `lanes` values per column) will read two tiles
    /// ahead: a tile reads its `C` columns as interleaved streams of a few cache lines each,
    /// which the hardware prefetcher does not run far enough ahead of (bf16, B = 1: 52 % of the
    /// bandwidth bound without this, 72 % with it).
    #[inline(always)]
    fn prefetch_ahead<T, const C: usize>(
        tiles: &Tiles<T>,
        first: usize,
        pass: usize,
        lanes: usize,
    ) {
        let pass_bytes = C * lanes * std::mem::size_of::<T>();
        let ahead = tiles
            .weights
            .as_ptr()
            .wrapping_add((first + 2 * C) * tiles.k_in) as *const u8;
        for line in (0..pass_bytes).step_by(64) {
            prefetch(ahead.wrapping_add(pass * pass_bytes + line));
        }
    }
}
