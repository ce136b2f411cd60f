//! How a step's loops spread over threads: over the `StepPool` the step entered (an
//! executor with `threads > 1` has one), or inline on the calling thread (one thread: no
//! worker exists to spin beside another model's, since two spinning pools on two cores
//! starve each other).

pub(crate) use super::pool::current_threads;
use super::pool::for_each_index;
use std::ops::Range;
use std::sync::Mutex;

/// `(0..count).map(f)`, collected in order.
pub fn map_indices<T, F>(count: usize, f: F) -> Vec<T>
where
    T: Send,
    F: Fn(usize) -> T + Sync + Send,
{
    if current_threads() == 1 {
        return (0..count).map(f).collect();
    }
    let slots: Vec<Mutex<Option<T>>> = (0..count).map(|_| Mutex::new(None)).collect();
    for_each_index(count, &|i| {
        *slots[i].lock().expect("one task per slot") = Some(f(i));
    });
    slots
        .into_iter()
        .map(|slot| {
            slot.into_inner()
                .expect("one task per slot")
                .expect("every task ran")
        })
        .collect()
}

/// `items.iter_mut().for_each(f)`, at least `min_len` items per parallel task.
pub fn for_each_mut<T, F>(items: &mut [T], min_len: usize, f: F)
where
    T: Send,
    F: Fn(&mut T) + Sync + Send,
{
    let threads = current_threads();
    if threads == 1 {
        return items.iter_mut().for_each(f);
    }
    let chunks: Vec<Mutex<&mut [T]>> = items
        .chunks_mut(chunk_len(items.len(), threads, min_len))
        .map(Mutex::new)
        .collect();
    for_each_index(chunks.len(), &|i| {
        chunks[i]
            .lock()
            .expect("one task per chunk")
            .iter_mut()
            .for_each(&f)
    });
}

/// How `fill_columns` shares a matmul's outputs out.
pub struct Split {
    /// Rows per task of a long input: the kernels' row chunk, so each task streams a
    /// matrix's weights once past rows that stay in cache.
    pub row_run: usize,
    /// Columns per task of a short input.
    pub cols_per_task: usize,
}

/// Fills row-major outputs (`outs[i]` is `[rows, n_out_i]`), all outputs' tasks in one
/// parallel region: `f(i, rows, columns, out)` writes output `i`'s block of `rows` and
/// `columns` row-major (`[rows, columns]`) into `out`.
///
/// A long input (a prompt; two runs per thread or more) is split by runs of
/// `split.row_run` rows over every column, so a task writes its rows of the output in place.
/// A short one (a decode batch) has too few rows to share out, so tasks take column ranges of
/// at most `split.cols_per_task`, each into a task-local buffer copied row by row into the
/// output. (In a 512-token prefill, zeroing and copying those buffers took 9 % of the
/// samples.)
pub fn fill_columns<F>(outs: &mut [Vec<f32>], rows: usize, split: Split, f: F)
where
    F: Fn(usize, Range<usize>, Range<usize>, &mut [f32]) + Sync + Send,
{
    if rows == 0 {
        return;
    }
    let row_run = split.row_run.max(1);
    if rows >= 2 * row_run * current_threads() {
        fill_row_runs(outs, rows, row_run, f);
    } else {
        fill_column_ranges(outs, rows, split.cols_per_task, f);
    }
}

/// `f(first_row, run)` over `x`'s rows of `row_len` values, cut into runs of `ROW_RUN` rows
/// that run in parallel once there are at least two; a decode batch's few rows run inline.
/// For the row-wise operations between a prompt's matmuls (norms, rope, SwiGLU, residual
/// adds), which otherwise ran on the stepping thread while the other threads spun.
pub fn for_each_row_run<F>(x: &mut [f32], row_len: usize, f: F)
where
    F: Fn(usize, &mut [f32]) + Sync + Send,
{
    let rows = x.len() / row_len.max(1);
    if rows <= ROW_RUN || current_threads() == 1 {
        return f(0, x);
    }
    let runs: Vec<Mutex<&mut [f32]>> = x.chunks_mut(ROW_RUN * row_len).map(Mutex::new).collect();
    for_each_index(runs.len(), &|i| {
        f(i * ROW_RUN, &mut runs[i].lock().expect("one task per run"))
    });
}

/// Rows per task of a row-wise operation on a long input.
const ROW_RUN: usize = 64;

fn fill_row_runs<F>(outs: &mut [Vec<f32>], rows: usize, row_run: usize, f: F)
where
    F: Fn(usize, Range<usize>, Range<usize>, &mut [f32]) + Sync + Send,
{
    let tasks: Vec<Mutex<RowRun>> = outs
        .iter_mut()
        .enumerate()
        .flat_map(|(i, out)| {
            let n_out = out.len() / rows;
            out.chunks_mut(row_run * n_out)
                .enumerate()
                .map(move |(run, block)| {
                    Mutex::new(RowRun {
                        output: i,
                        first_row: run * row_run,
                        n_out,
                        block,
                    })
                })
        })
        .collect();
    for_each_index(tasks.len(), &|t| {
        let mut task = tasks[t].lock().expect("one task per run");
        let RowRun {
            output,
            first_row,
            n_out,
            ref mut block,
        } = *task;
        let rows = first_row..first_row + block.len() / n_out;
        f(output, rows, 0..n_out, block)
    });
}

/// One task of `fill_row_runs`: output `output`'s rows from `first_row`, all of its `n_out`
/// columns, in place.
struct RowRun<'a> {
    output: usize,
    first_row: usize,
    n_out: usize,
    block: &'a mut [f32],
}

fn fill_column_ranges<F>(outs: &mut [Vec<f32>], rows: usize, cols_per_task: usize, f: F)
where
    F: Fn(usize, Range<usize>, Range<usize>, &mut [f32]) + Sync + Send,
{
    let targets: Vec<(SharedColumns, usize)> = outs
        .iter_mut()
        .map(|out| (SharedColumns(out.as_mut_ptr()), out.len() / rows))
        .collect();
    let tasks: Vec<(usize, Range<usize>)> = targets
        .iter()
        .enumerate()
        .flat_map(|(i, &(_, n_out))| {
            (0..n_out.div_ceil(cols_per_task))
                .map(move |t| (i, t * cols_per_task..((t + 1) * cols_per_task).min(n_out)))
        })
        .collect();
    let task = |t: usize| {
        let (i, columns) = tasks[t].clone();
        let (target, n_out) = &targets[i];
        let mut buffer = vec![0f32; columns.len() * rows];
        f(i, 0..rows, columns.clone(), &mut buffer);
        for (r, segment) in buffer.chunks_exact(columns.len()).enumerate() {
            // SAFETY: `r < rows` and `columns.end <= n_out`, so the segment is inside output
            // `i`; tasks own disjoint column ranges, so no element is written twice, and the
            // outputs are borrowed mutably for the whole call.
            unsafe { target.write_segment(r * n_out + columns.start, segment) };
        }
    };
    for_each_index(tasks.len(), &task);
}

/// `out`'s base pointer, shared by tasks that write disjoint columns.
struct SharedColumns(*mut f32);
// SAFETY: only `fill_columns` uses it, and its tasks write disjoint elements.
unsafe impl Sync for SharedColumns {}

impl SharedColumns {
    /// # Safety
    /// `start..start + values.len()` is inside the buffer and no other thread touches those
    /// elements meanwhile.
    unsafe fn write_segment(&self, start: usize, values: &[f32]) {
        std::ptr::copy_nonoverlapping(values.as_ptr(), self.0.add(start), values.len());
    }
}

/// Chunks a pool of `threads` should cut `items` into: a few per thread (load balance), none
/// smaller than `min_len` (scheduling cost).
pub fn chunk_len(items: usize, threads: usize, min_len: usize) -> usize {
    let chunks = (threads * 4).max(1);
    items.div_ceil(chunks).max(min_len).max(1)
}

#[cfg(test)]
mod tests {
    use super::*;

    use crate::engine::pool::StepPool;

    #[test]
    fn inline_and_pooled_runs_give_the_same_result() {
        let run = || {
            let mut squares: Vec<usize> = (0..37).collect();
            for_each_mut(&mut squares, 4, |x| *x *= *x);
            (map_indices(17, |i| i * i), squares)
        };
        let inline = run();
        let pool = StepPool::new(2, "test").unwrap();
        assert_eq!(pool.enter(run), inline);
        assert_eq!(inline.0[4], 16);
        assert_eq!(inline.1[36], 36 * 36);
    }

    /// Both splits (column ranges for few rows, row runs for many) inline and pooled.
    #[test]
    fn fill_columns_writes_every_block_to_its_place() {
        for rows in [3, 4 * ROW_RUN + 5] {
            let n_outs = [10, 5];
            let run = || {
                let mut outs: Vec<Vec<f32>> =
                    n_outs.iter().map(|n| vec![f32::NAN; rows * n]).collect();
                let split = Split {
                    row_run: ROW_RUN,
                    cols_per_task: 4,
                };
                fill_columns(&mut outs, rows, split, |i, rows, columns, out| {
                    assert_eq!(out.len(), rows.len() * columns.len());
                    for (r, row) in rows.zip(out.chunks_mut(columns.len())) {
                        for (c, v) in columns.clone().zip(row) {
                            *v = (i * 100_000 + r * 100 + c) as f32;
                        }
                    }
                });
                outs
            };
            let expected: Vec<Vec<f32>> = n_outs
                .iter()
                .enumerate()
                .map(|(i, &n)| {
                    (0..rows)
                        .flat_map(|r| (0..n).map(move |c| (i * 100_000 + r * 100 + c) as f32))
                        .collect()
                })
                .collect();
            assert_eq!(run(), expected, "{rows} rows inline");
            let pool = StepPool::new(2, "test").unwrap();
            assert_eq!(pool.enter(run), expected, "{rows} rows pooled");
        }
    }

    /// Every row once, with its own index, inline and pooled, short and long inputs.
    #[test]
    fn for_each_row_run_visits_every_row_once_with_its_index() {
        for rows in [3, ROW_RUN, 3 * ROW_RUN + 5] {
            let run = || {
                let mut x = vec![0f32; rows * 7];
                for_each_row_run(&mut x, 7, |first, run| {
                    for (r, row) in run.chunks_exact_mut(7).enumerate() {
                        row.iter_mut().for_each(|v| *v += (first + r) as f32);
                    }
                });
                x
            };
            let expected: Vec<f32> = (0..rows).flat_map(|r| [r as f32; 7]).collect();
            assert_eq!(run(), expected, "{rows} rows inline");
            let pool = StepPool::new(2, "test").unwrap();
            assert_eq!(pool.enter(run), expected, "{rows} rows pooled");
        }
    }

    #[test]
    fn chunk_len_balances_and_respects_the_minimum() {
        assert_eq!(chunk_len(576, 2, 16), 72);
        assert_eq!(chunk_len(40, 2, 16), 16);
        assert_eq!(chunk_len(0, 1, 16), 16);
    }
}
