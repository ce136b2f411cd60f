//! Benchmarks: engine step cost per batch size, and the quality/cost of a model pair.
//! Long sweeps live here, not in `cargo test`.

pub mod answers;
pub mod bandwidth;
pub mod engine;
pub mod load;
pub mod pair;
pub mod parity;
pub mod plots;
pub mod prompts;
pub mod quality;
pub mod remote;
pub mod routing;
pub mod slow_clients;
pub mod soak;
pub mod std_serving;
pub mod validate;
pub mod workloads;

/// Runs `job(i)` for every `i` in `0..count`, `concurrency` at a time: each worker takes the
/// next index as soon as its job ends (closed-loop clients). Returns once every job has.
pub async fn for_each_closed_loop<F, Job>(concurrency: usize, count: usize, job: F)
where
    F: Fn(usize) -> Job + Clone + 'static,
    Job: std::future::Future<Output = ()> + 'static,
{
    for_each_closed_loop_while(concurrency, move |i| i < count, job).await
}

/// As `for_each_closed_loop`, starting job `i` while `more(i)` holds.
pub async fn for_each_closed_loop_while<M, F, Job>(concurrency: usize, more: M, job: F)
where
    M: Fn(usize) -> bool + Clone + 'static,
    F: Fn(usize) -> Job + Clone + 'static,
    Job: std::future::Future<Output = ()> + 'static,
{
    let next = std::rc::Rc::new(std::cell::Cell::new(0usize));
    let workers: Vec<_> = (0..concurrency)
        .map(|_| {
            let (next, job, more) = (next.clone(), job.clone(), more.clone());
            actix_rt::spawn(async move {
                loop {
                    let i = next.get();
                    if !more(i) {
                        break;
                    }
                    next.set(i + 1);
                    job(i).await;
                }
            })
        })
        .collect();
    for worker in workers {
        let _ = worker.await;
    }
}

/// Median of a non-empty sample.
pub fn median(values: &mut [f64]) -> f64 {
    values.sort_by(f64::total_cmp);
    let n = values.len();
    if n % 2 == 1 {
        values[n / 2]
    } else {
        (values[n / 2 - 1] + values[n / 2]) / 2.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn median_of_odd_and_even_samples() {
        assert_eq!(median(&mut [3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(&mut [4.0, 1.0, 2.0, 3.0]), 2.5);
    }
}
