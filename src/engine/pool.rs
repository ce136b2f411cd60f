//! The threads one model's steps run on. A step is a few hundred short parallel regions (a
//! few per layer), so what a region costs to start matters: rayon parks a worker that finds
//! no work after ~32 yields, and waking a parked thread in a VM (a futex, an IPI to a halted
//! vCPU) took long enough that a B = 1 decode step of the Q4_1 model at 2 threads ran in
//! 10.0 ms on rayon and in 7.6 ms on rayon with its parking delayed (docs/engine.md). Here a
//! worker spins between regions and parks only after `SPIN` without one, so the regions of a
//! step never wait for a wake-up, while a model with nothing to do gives its cores back.
//!
//! The thread that enters the pool runs tasks too, so `threads` threads work on a region.

use std::any::Any;
use std::cell::Cell;
use std::marker::PhantomData;
use std::panic::{catch_unwind, resume_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// How long a worker without a region spins (yielding now and then) before it parks.
const SPIN: Duration = Duration::from_millis(2);
/// Spins between two looks at the clock (and a yield to any other runnable thread).
const SPINS_PER_YIELD: usize = 64;

type Task<'a> = dyn Fn(usize) + Sync + 'a;

/// A region as workers see it. The task's lifetime is erased: `StepPool::run` does not
/// return while a worker still holds the region.
#[derive(Clone, Copy)]
struct Region {
    epoch: u64,
    task: *const Task<'static>,
    count: usize,
}

// SAFETY: the task is `Sync`, and `run` keeps it alive while any worker can reach it.
unsafe impl Send for Region {}

struct Shared {
    /// Bumped once per region; idle workers watch it.
    epoch: AtomicU64,
    region: Mutex<Option<Region>>,
    /// The next task index to hand out.
    next: AtomicUsize,
    /// Workers that joined the current region and have not left it.
    active: AtomicUsize,
    /// The first panic of a region's tasks, raised again on the entering thread.
    panic: Mutex<Option<Box<dyn Any + Send>>>,
    parked: Mutex<()>,
    wake: Condvar,
    sleepers: AtomicUsize,
    shutdown: AtomicBool,
}

/// A model's worker threads; used from the thread that owns it (hence not `Sync`).
pub struct StepPool {
    shared: Arc<Shared>,
    workers: Vec<JoinHandle<()>>,
    not_sync: PhantomData<Cell<()>>,
}

thread_local! {
    /// The pool `for_each_index` spreads over: set by `StepPool::enter`, cleared while the
    /// entering thread runs a region's tasks (so regions inside tasks run inline).
    static CURRENT: Cell<Option<*const StepPool>> = const { Cell::new(None) };
}

/// Puts `CURRENT` back when dropped (also when a task panics).
struct RestoreCurrent(Option<*const StepPool>);

impl Drop for RestoreCurrent {
    fn drop(&mut self) {
        CURRENT.set(self.0);
    }
}

impl StepPool {
    /// `threads` threads in all: the entering thread and `threads - 1` workers named
    /// `{name}-{i}`.
    pub fn new(threads: usize, name: &str) -> std::io::Result<Self> {
        let shared = Arc::new(Shared {
            epoch: AtomicU64::new(0),
            region: Mutex::new(None),
            next: AtomicUsize::new(0),
            active: AtomicUsize::new(0),
            panic: Mutex::new(None),
            parked: Mutex::new(()),
            wake: Condvar::new(),
            sleepers: AtomicUsize::new(0),
            shutdown: AtomicBool::new(false),
        });
        let mut pool = Self {
            shared,
            workers: Vec::new(),
            not_sync: PhantomData,
        };
        for i in 1..threads.max(1) {
            let shared = Arc::clone(&pool.shared);
            let worker = std::thread::Builder::new()
                .name(format!("{name}-{i}"))
                .spawn(move || work(&shared))?;
            // On an error here, dropping `pool` stops the workers already started.
            pool.workers.push(worker);
        }
        Ok(pool)
    }

    pub fn threads(&self) -> usize {
        self.workers.len() + 1
    }

    /// Runs `f` with this pool as the one `for_each_index` spreads over on this thread.
    pub fn enter<R>(&self, f: impl FnOnce() -> R) -> R {
        let _restore = RestoreCurrent(CURRENT.replace(Some(self as *const Self)));
        f()
    }

    /// Runs `task(i)` for every `i < count` on all threads; returns when all are done.
    fn run(&self, count: usize, task: &Task<'_>) {
        let shared = &*self.shared;
        shared.next.store(0, Ordering::Relaxed);
        let epoch = shared.epoch.load(Ordering::Relaxed) + 1;
        // SAFETY: only the lifetime is erased; the region is withdrawn and every worker that
        // joined it has left before this function returns, so no worker calls it later.
        let erased: *const Task<'static> = unsafe { std::mem::transmute(task as *const Task<'_>) };
        *lock(&shared.region) = Some(Region {
            epoch,
            task: erased,
            count,
        });
        shared.epoch.store(epoch, Ordering::SeqCst);
        if shared.sleepers.load(Ordering::SeqCst) > 0 {
            // Holding the lock once means every worker that counted itself a sleeper is
            // waiting on `wake` by now, so this notification cannot be lost.
            drop(lock(&shared.parked));
            shared.wake.notify_all();
        }
        run_tasks(shared, task, count);
        *lock(&shared.region) = None;
        while shared.active.load(Ordering::Acquire) > 0 {
            std::hint::spin_loop();
        }
        if let Some(payload) = lock(&shared.panic).take() {
            resume_unwind(payload);
        }
    }
}

impl Drop for StepPool {
    fn drop(&mut self) {
        self.shared.shutdown.store(true, Ordering::SeqCst);
        drop(lock(&self.shared.parked));
        self.shared.wake.notify_all();
        for worker in self.workers.drain(..) {
            // A worker only ends by seeing `shutdown`; task panics are caught in it.
            let _ = worker.join();
        }
    }
}

/// Runs `task(i)` for every `i < count`: over the pool this thread entered, or inline
/// outside a pool and inside a region's task.
pub fn for_each_index(count: usize, task: &(dyn Fn(usize) + Sync)) {
    match CURRENT.get() {
        Some(pool) if count > 1 => {
            let _restore = RestoreCurrent(CURRENT.replace(None));
            // SAFETY: `enter` set it and has not returned (it is on this thread's stack).
            unsafe { &*pool }.run(count, task);
        }
        _ => (0..count).for_each(task),
    }
}

/// Threads of the pool this thread entered; 1 outside one (and inside a region's task).
pub fn current_threads() -> usize {
    // SAFETY: as in `for_each_index`.
    CURRENT.get().map_or(1, |pool| unsafe { &*pool }.threads())
}

/// A poisoned lock only means a task panicked; the panic itself is passed on by `run`.
fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

fn run_tasks(shared: &Shared, task: &Task<'_>, count: usize) {
    loop {
        let i = shared.next.fetch_add(1, Ordering::Relaxed);
        if i >= count {
            return;
        }
        if let Err(payload) = catch_unwind(AssertUnwindSafe(|| task(i))) {
            lock(&shared.panic).get_or_insert(payload);
        }
    }
}

fn work(shared: &Shared) {
    let mut seen = 0;
    loop {
        seen = wait_for_region(shared, seen);
        if shared.shutdown.load(Ordering::SeqCst) {
            return;
        }
        let region = {
            let slot = lock(&shared.region);
            match *slot {
                Some(region) if region.epoch == seen => {
                    shared.active.fetch_add(1, Ordering::AcqRel);
                    region
                }
                // That region ended before this worker came.
                _ => continue,
            }
        };
        // SAFETY: `run` does not return while `active` counts this worker.
        let task = unsafe { &*region.task };
        run_tasks(shared, task, region.count);
        shared.active.fetch_sub(1, Ordering::Release);
    }
}

/// Waits until the epoch differs from `seen` (or the pool shuts down): spinning for `SPIN`,
/// then parked.
fn wait_for_region(shared: &Shared, seen: u64) -> u64 {
    let changed = || {
        let epoch = shared.epoch.load(Ordering::SeqCst);
        (epoch != seen || shared.shutdown.load(Ordering::SeqCst)).then_some(epoch)
    };
    let start = Instant::now();
    while start.elapsed() < SPIN {
        for _ in 0..SPINS_PER_YIELD {
            if let Some(epoch) = changed() {
                return epoch;
            }
            std::hint::spin_loop();
        }
        std::thread::yield_now();
    }
    let mut guard = lock(&shared.parked);
    shared.sleepers.fetch_add(1, Ordering::SeqCst);
    let epoch = loop {
        if let Some(epoch) = changed() {
            break epoch;
        }
        guard = shared
            .wake
            .wait(guard)
            .unwrap_or_else(|poisoned| poisoned.into_inner());
    };
    shared.sleepers.fetch_sub(1, Ordering::SeqCst);
    epoch
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashSet;
    use std::sync::Mutex;

    /// Every index runs exactly once, on more than one thread when the pool has two.
    #[test]
    fn every_task_runs_once_and_workers_share_them() {
        let pool = StepPool::new(2, "test").unwrap();
        let runs = Mutex::new(Vec::new());
        let threads = Mutex::new(HashSet::new());
        pool.enter(|| {
            for region in 0..200 {
                for_each_index(64, &|i| {
                    runs.lock().unwrap().push(i);
                    threads.lock().unwrap().insert(std::thread::current().id());
                    // In the first region each task waits for the other thread to have taken
                    // one (or gives up), so sharing does not hang on how soon a loaded
                    // machine schedules the worker.
                    let start = Instant::now();
                    while region == 0
                        && threads.lock().unwrap().len() < 2
                        && start.elapsed().as_secs() < 20
                    {
                        std::thread::yield_now();
                    }
                    std::hint::black_box((0..2000).sum::<usize>());
                });
            }
        });
        let mut runs = runs.into_inner().unwrap();
        runs.sort_unstable();
        let want: Vec<usize> = (0..64).flat_map(|i| [i; 200]).collect();
        assert_eq!(runs, want);
        assert_eq!(threads.into_inner().unwrap().len(), 2);
    }

    /// A region after the workers parked still runs all its tasks on both threads.
    #[test]
    fn parked_workers_wake_for_the_next_region() {
        let pool = StepPool::new(2, "test").unwrap();
        for _ in 0..3 {
            std::thread::sleep(SPIN * 5);
            let threads = Mutex::new(HashSet::new());
            let done = AtomicUsize::new(0);
            pool.enter(|| {
                for_each_index(8, &|_| {
                    threads.lock().unwrap().insert(std::thread::current().id());
                    // Each task waits for the worker to have taken one (or gives up).
                    let start = Instant::now();
                    while threads.lock().unwrap().len() < 2 && start.elapsed().as_secs() < 20 {
                        std::thread::yield_now();
                    }
                    done.fetch_add(1, Ordering::Relaxed);
                })
            });
            assert_eq!(done.load(Ordering::Relaxed), 8);
            assert_eq!(
                threads.into_inner().unwrap().len(),
                2,
                "the worker never woke"
            );
        }
    }

    #[test]
    fn a_task_panic_reaches_the_caller_and_the_pool_keeps_working() {
        let pool = StepPool::new(2, "test").unwrap();
        let outcome = catch_unwind(AssertUnwindSafe(|| {
            pool.enter(|| for_each_index(16, &|i| assert_ne!(i, 11, "task 11 fails")))
        }));
        let message = outcome.unwrap_err();
        let message = message
            .downcast_ref::<String>()
            .expect("the task's own panic message");
        assert!(message.contains("task 11 fails"), "{message}");
        let sum = AtomicUsize::new(0);
        pool.enter(|| {
            for_each_index(16, &|i| {
                sum.fetch_add(i, Ordering::Relaxed);
            })
        });
        assert_eq!(sum.into_inner(), (0..16).sum::<usize>());
    }

    /// Inside a task, and outside `enter`, regions run inline on the calling thread.
    #[test]
    fn nested_and_unentered_regions_run_inline() {
        let pool = StepPool::new(2, "test").unwrap();
        assert_eq!(current_threads(), 1);
        let inner_threads = Mutex::new(Vec::new());
        pool.enter(|| {
            assert_eq!(current_threads(), 2);
            for_each_index(4, &|_| {
                assert_eq!(current_threads(), 1);
                let me = std::thread::current().id();
                for_each_index(3, &|_| {
                    inner_threads
                        .lock()
                        .unwrap()
                        .push(std::thread::current().id() == me)
                });
            });
            assert_eq!(current_threads(), 2);
        });
        assert_eq!(current_threads(), 1);
        assert_eq!(inner_threads.into_inner().unwrap(), vec![true; 12]);
    }
}
