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

/// Fills row-major outputs (`outs[i]` is `[rows, n_out_i]`) by column ranges of at most
/// `cols_per_task`, all outputs' ranges in one parallel region: `f(i, columns, buffer)` writes
/// output `i`'s range row-major (`[rows, columns]`) into a task-local `buffer` (its writes
/// stay in cache), and the task copies each row's segment into the output.
pub fn fill_columns<F>(outs: &mut [Vec<f32>], rows: usize, cols_per_task: usize, f: F)
where
    F: Fn(usize, Range<usize>, &mut [f32]) + Sync + Send,
{
    if rows == 0 {
        return;
    }
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
        f(i, columns.clone(), &mut buffer);
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

    #[test]
    fn fill_columns_scatters_every_range_to_its_columns() {
        let (rows, n_out) = (3, 10);
        let run = || {
            let mut outs = vec![vec![f32::NAN; rows * n_out], vec![f32::NAN; rows * 5]];
            fill_columns(&mut outs, rows, 4, |i, columns, buffer| {
                for (r, row) in buffer.chunks_mut(columns.len()).enumerate() {
                    for (c, v) in columns.clone().zip(row) {
                        *v = (i * 1000 + r * 100 + c) as f32;
                    }
                }
            });
            outs
        };
        let inline = run();
        let expected: Vec<Vec<f32>> = [n_out, 5]
            .iter()
            .enumerate()
            .map(|(i, &n)| {
                (0..rows)
                    .flat_map(|r| (0..n).map(move |c| (i * 1000 + r * 100 + c) as f32))
                    .collect()
            })
            .collect();
        assert_eq!(inline, expected);
        let pool = StepPool::new(2, "test").unwrap();
        assert_eq!(pool.enter(run), expected);
    }

    #[test]
    fn chunk_len_balances_and_respects_the_minimum() {
        assert_eq!(chunk_len(576, 2, 16), 72);
        assert_eq!(chunk_len(40, 2, 16), 16);
        assert_eq!(chunk_len(0, 1, 16), 16);
    }
}
