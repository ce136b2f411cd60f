//! Decode steps replayed as CUDA graphs: the whole step (embedding lookup to the logits'
//! statistics) captured once per bucket of rows (`step_inputs::DECODE_BUCKETS`) over buffers
//! it keeps, then replayed after one copy of the step's packed inputs. A small model's step is
//! hundreds of kernel launches (304 for the shipped 135M model), whose host-side cost a replay
//! pays once.

use super::buffers::{DeviceInputs, HeadBuffers, StepBuffers};
use super::paged_kv::PagedKv;
use super::{gpu_error, DeviceModel, LastPositions};
use crate::engine::kv::{KvStore, BLOCK_TOKENS};
use crate::engine::step_inputs::{decode_bucket, SequenceRows, StepInputs};
use crate::engine::weights::Hyperparams;
use crate::error::{EngineError, EngineResult};
use cudarc::driver::sys::{CUgraphInstantiate_flags, CUstreamCaptureMode};
use cudarc::driver::CudaGraph;

/// A captured graph the executor that owns it moves between threads.
struct OwnedGraph(CudaGraph);

// SAFETY: CUDA graph objects are not internally synchronized, so they must never be used from
// two threads at once; an `OwnedGraph` is reached only through its executor's `&mut self`.
unsafe impl Send for OwnedGraph {}

/// One bucket's captured step and the buffers its kernels read and write.
struct DecodeGraph {
    bucket: usize,
    inputs: DeviceInputs,
    /// Read only by the graph's kernels, which point into them.
    _buffers: StepBuffers,
    head: HeadBuffers,
    graph: OwnedGraph,
    /// Kernels one replay runs.
    kernels: usize,
}

pub struct DecodeGraphs {
    enabled: bool,
    /// Block-table entries per row: enough for the longest sequence the model holds.
    table_width: usize,
    graphs: Vec<DecodeGraph>,
}

impl DecodeGraphs {
    pub fn new(enabled: bool, hp: &Hyperparams, kv: &KvStore) -> Self {
        Self {
            enabled,
            table_width: kv.capacity_blocks().min(hp.context.div_ceil(BLOCK_TOKENS)),
            graphs: Vec::new(),
        }
    }

    /// The buckets captured so far, smallest first.
    pub fn captured(&self) -> Vec<usize> {
        let mut buckets: Vec<usize> = self.graphs.iter().map(|g| g.bucket).collect();
        buckets.sort_unstable();
        buckets
    }

    /// The bucket and packed inputs a step replays with, capturing the bucket's graph first
    /// if needed; `None` for a step to run eagerly: not a decode step, graphs off, or a
    /// capture that failed (said once; graphs are then off for this executor).
    pub fn for_step(
        &mut self,
        model: &DeviceModel,
        paged: &mut PagedKv,
        sequences: &[SequenceRows],
    ) -> Option<(usize, StepInputs)> {
        if !self.enabled {
            return None;
        }
        let bucket = decode_bucket(sequences.len())?;
        let inputs = StepInputs::decode(sequences, bucket, self.table_width)?;
        if self.graphs.iter().all(|g| g.bucket != bucket) {
            match self.capture(model, paged, bucket) {
                Ok(graph) => self.graphs.push(graph),
                Err(e) => {
                    tracing::warn!(
                        "CUDA graph capture for {bucket} rows failed, running steps eagerly: {e}"
                    );
                    self.enabled = false;
                    return None;
                }
            }
        }
        Some((bucket, inputs))
    }

    /// Replays `bucket`'s graph on `inputs` and reads the first `seqs` rows' results.
    pub fn replay(
        &mut self,
        model: &DeviceModel,
        bucket: usize,
        inputs: &StepInputs,
        seqs: usize,
        top_k: usize,
    ) -> EngineResult<LastPositions> {
        let graph = self
            .graphs
            .iter_mut()
            .find(|g| g.bucket == bucket)
            .ok_or_else(|| EngineError::Gpu(format!("no decode graph for {bucket} rows")))?;
        graph.inputs.refill(&model.gpu, inputs)?;
        graph.graph.0.launch().map_err(gpu_error)?;
        model.gpu.count_launches(graph.kernels);
        model.read_head(&graph.head, seqs, top_k)
    }

    /// Runs the step once eagerly on padding rows (a warm-up: libraries allocate what they
    /// need outside the capture), then captures it.
    fn capture(
        &self,
        model: &DeviceModel,
        paged: &mut PagedKv,
        bucket: usize,
    ) -> EngineResult<DecodeGraph> {
        let gpu = &model.gpu;
        let padding = StepInputs::decode(&[], bucket, self.table_width)
            .expect("an empty step fits every bucket");
        let inputs = DeviceInputs::upload(gpu, &padding)?;
        let mut buffers = StepBuffers::new(model, bucket)?;
        let mut head = HeadBuffers::new(model, bucket)?;
        // A decode row is its sequence's last row: the head reads the stack's output as is.
        let mut run = |buffers: &mut StepBuffers, head: &mut HeadBuffers| -> EngineResult<()> {
            model.body(paged, &inputs, buffers)?;
            model.head(&buffers.x, bucket, &mut buffers.scratch, head)
        };
        run(&mut buffers, &mut head)?;
        gpu.stream.synchronize().map_err(gpu_error)?;
        let before = gpu.launches();
        // Relaxed: another executor's thread may allocate while this one captures.
        gpu.stream
            .begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED)
            .map_err(gpu_error)?;
        let captured = run(&mut buffers, &mut head);
        // Ended whatever happened in between, so that a failed capture leaves the stream usable.
        let graph = gpu
            .stream
            .end_capture(CUgraphInstantiate_flags(0))
            .map_err(gpu_error);
        captured?;
        let graph =
            graph?.ok_or_else(|| EngineError::Gpu("the capture recorded nothing".into()))?;
        graph.upload().map_err(gpu_error)?;
        Ok(DecodeGraph {
            bucket,
            inputs,
            _buffers: buffers,
            head,
            graph: OwnedGraph(graph),
            kernels: gpu.launches() - before,
        })
    }
}
