//! A constrained request's grammar state through the core's transitions: it travels with the
//! request, only commits advance it (a rejected candidate never does), the model a request
//! moves to masks by the same state, and a token outside the grammar fails the request.

use super::*;
use crate::constraint::{ascii_token, vocabulary_for_tests, OutputFormat, RequestGrammar};

fn constrained(rid: u64) -> (InFlight<u64>, Arc<RequestGrammar>) {
    let vocabulary = vocabulary_for_tests(&[]);
    let grammar = Arc::new(
        RequestGrammar::new(&OutputFormat::JsonObject, &[vocabulary.clone(), vocabulary])
            .expect("compiles"),
    );
    let mut r = request(rid, &[5, 6, 7], 16);
    r.grammar = Some(grammar.clone());
    (r, grammar)
}

/// Every token `mask` allows among the test vocabulary's.
fn allowed(mask: crate::engine::TokenMask) -> Vec<u32> {
    (0..300).filter(|&t| mask.allows(t)).collect()
}

fn has_filter(work: &[SeqWork]) -> bool {
    work.len() == 1 && work[0].filter.is_some()
}

#[test]
fn the_grammar_moves_with_the_request_and_only_commits_advance_it() {
    let (mut kv0, mut kv1) = (KvStore::new(1024), KvStore::new(1024));
    let mut m0 = scheduler(ExecutionMode::Async);
    let mut m1 = ModelScheduler::new(1, 2, "m1", ExecutionMode::Async, StepLimits::unlimited());
    let (r, grammar) = constrained(1);
    m0.admit(&mut kv0, r, true);

    assert_eq!(allowed(grammar.mask(0)), vec![ascii_token(b'{')]);
    let (work, effects) = step(&mut m0, &mut kv0, ascii_token(b'{'), &[]);
    assert!(has_filter(&work));
    assert_eq!(committed(&effects), vec![(1, ascii_token(b'{'))]);
    assert_eq!(grammar.committed(), b"{");

    // The SLM's next candidate is rejected: the grammar does not see it.
    let (_, effects) = step(
        &mut m0,
        &mut kv0,
        ascii_token(b'"'),
        &[Route::RejectAndSwitch(1)],
    );
    let moved = handed_off(effects);
    assert_eq!(grammar.committed(), b"{");
    assert!(Arc::ptr_eq(moved.grammar.as_ref().unwrap(), &grammar));

    // The model it moved to masks by the same state: `{` is done, a key or `}` follows.
    m1.admit(&mut kv1, moved, true);
    assert_eq!(
        allowed(grammar.mask(1)),
        vec![ascii_token(b'"'), ascii_token(b'}')]
    );
    let (work, effects) = step(&mut m1, &mut kv1, ascii_token(b'}'), &[]);
    assert!(has_filter(&work));
    assert_eq!(committed(&effects), vec![(1, ascii_token(b'}'))]);
    assert_eq!(grammar.committed(), b"{}");

    // Complete: only the end is allowed, and it finishes the request.
    assert_eq!(allowed(grammar.mask(1)), vec![EOS]);
    let (_, effects) = step(&mut m1, &mut kv1, EOS, &[]);
    assert!(effects.iter().any(|e| matches!(
        e,
        Effect::Finish {
            reason: FinishReason::Stop,
            ..
        }
    )));
}

#[test]
fn a_committed_token_outside_the_grammar_fails_the_request() {
    let mut kv = KvStore::new(1024);
    let mut s = scheduler(ExecutionMode::Tokenrouter);
    let (r, grammar) = constrained(1);
    s.admit(&mut kv, r, true);
    let (_, effects) = step(&mut s, &mut kv, ascii_token(b'a'), &[]);
    assert_eq!(fails(&effects), vec![(1, FailureKind::Fault)]);
    assert!(committed(&effects).is_empty());
    assert!(grammar.error().is_some());
    assert_eq!(s.resident(), 0, "its KV released");
}

#[test]
fn chunk_rows_and_unconstrained_rows_carry_no_filter() {
    let mut kv = KvStore::new(1024);
    let mut s = ModelScheduler::new(0, 2, "m0", ExecutionMode::Async, budget(2.0));
    let (r, _) = constrained(1);
    s.admit(&mut kv, r, true);
    s.admit(&mut kv, request(2, &[8], 4), true);
    let (plan, _) = s.schedule(&mut kv);
    for (row, work) in plan.rows.iter().zip(&plan.work) {
        let rid = s.resident[row.resident].rid().0;
        let expected = rid == 1 && row.completes;
        assert_eq!(work.filter.is_some(), expected, "request {rid}");
    }
    assert!(plan.rows.iter().any(|row| !row.completes), "a chunk ran");
}

#[test]
fn one_matcher_survives_pending_preemption_resume_and_cancellation() {
    // 4 blocks: room for the constrained request and one more, not two more.
    let mut kv0 = KvStore::new(4 * BLOCK_TOKENS);
    kv0.set_prefix_sharing(false);
    let mut kv1 = KvStore::new(1024);
    let mut m0 = scheduler(ExecutionMode::Tokenrouter);
    let mut m1 = ModelScheduler::new(
        1,
        2,
        "m1",
        ExecutionMode::Tokenrouter,
        StepLimits::unlimited(),
    );
    let (r, grammar) = constrained(1);
    m0.admit(&mut kv0, r, true);
    let (_, effects) = step(
        &mut m0,
        &mut kv0,
        ascii_token(b'{'),
        &[Route::CommitThenSwitch(1)],
    );
    assert_eq!((m0.resident(), m0.pending()), (0, 1), "pending on m0");

    // While m1 writes, m0's KV is wanted by a long prompt: the pending request is preempted.
    m1.admit(&mut kv1, handed_off(effects), true);
    m0.admit(&mut kv0, request(2, &[9; 3 * BLOCK_TOKENS + 1], 4), true);
    let (work, _) = step(&mut m0, &mut kv0, 9, &[]);
    assert!(
        !has_filter(&work),
        "the unconstrained prompt carries no mask"
    );
    assert_eq!((m0.counters().preemptions, m0.pending()), (1, 0));
    assert_eq!(
        grammar.committed(),
        b"{",
        "preemption leaves the grammar alone"
    );
    let (_, effects) = step(
        &mut m1,
        &mut kv1,
        ascii_token(b'"'),
        &[Route::CommitThenSwitch(0)],
    );
    assert_eq!(grammar.committed(), b"{\"");

    // Back on m0 it recomputes its sequence from the committed tokens (the row that samples
    // is the only one masked) and the grammar is not advanced again by the catch-up.
    m0.drop_ended(&mut kv0, |rid| rid != RequestId(2));
    m0.admit(&mut kv0, handed_off(effects), true);
    let (work, effects) = step(&mut m0, &mut kv0, ascii_token(b'a'), &[]);
    assert!(has_filter(&work));
    assert_eq!(work[0].tokens.len(), 5, "prompt, `{{` and `\"` again");
    assert_eq!(committed(&effects), vec![(1, ascii_token(b'a'))]);
    assert_eq!(grammar.committed(), b"{\"a");
    assert!(
        allowed(grammar.mask(0)).contains(&ascii_token(b'"')),
        "m0 masks by the one state: the key may close"
    );

    // Cancelled: dropping the request drops its grammar state with it (the step's work,
    // whose mask filter holds it too, is gone by then).
    drop(work);
    assert_eq!(Arc::strong_count(&grammar), 2);
    m0.drop_ended(&mut kv0, |_| false);
    assert_eq!(Arc::strong_count(&grammar), 1);
}
