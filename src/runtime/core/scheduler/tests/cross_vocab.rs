//! A request routed between models of two vocabularies (the real SmolLM2 and Gemma 3
//! tokenizers) through the core: each model's routing state holds its own tokens of the
//! committed text, a receiver's KV rolls back to its last stable boundary, a handoff waits
//! for a whole character, and counts are of committed tokens whoever wrote them.

use super::*;
use crate::engine::spelling::{real_spellings, Spelling};
use crate::runtime::core::{CrossVocab, Vocabularies};

const SMOL_PROMPT: [u32; 3] = [5, 6, 7];
const GEMMA_PROMPT: [u32; 4] = [2, 10, 11, 12];
const SMOL_EOS: u32 = 2;
const GEMMA_EOS: u32 = 1;

/// Model 0 reads SmolLM2's vocabulary, model 1 Gemma's; the request enters at model 0.
fn cross_request(spellings: &[Arc<Spelling>; 2], max_tokens: usize) -> InFlight<u64> {
    let vocabularies = Arc::new(Vocabularies::new(vec![0, 1], spellings.to_vec()));
    let eos = vec![
        Arc::new(BTreeSet::from([SMOL_EOS])),
        Arc::new(BTreeSet::from([GEMMA_EOS])),
    ];
    let prompts = vec![SMOL_PROMPT.to_vec(), GEMMA_PROMPT.to_vec()];
    let (cross, first) = CrossVocab::new(vocabularies, prompts, eos, 0, SMOL_PROMPT.len());
    let mut r = request(1, &first, max_tokens);
    r.cross = Some(Box::new(cross));
    r
}

/// Runs one step of a resident request with `candidate` and `route`.
fn step_one(
    s: &mut ModelScheduler<u64>,
    kv: &mut KvStore,
    candidate: u32,
    route: Route,
) -> (Vec<SeqWork>, Vec<Effect<u64>>) {
    step(s, kv, candidate, &[route])
}

/// Writes `tokens` on `s`, the last one with `last`; returns the last step's effects.
fn write(
    s: &mut ModelScheduler<u64>,
    kv: &mut KvStore,
    tokens: &[u32],
    last: Route,
) -> Vec<Effect<u64>> {
    let (&final_token, rest) = tokens.split_last().expect("tokens to write");
    for &token in rest {
        let (_, effects) = step_one(s, kv, token, Route::Stay);
        assert!(fails(&effects).is_empty());
    }
    step_one(s, kv, final_token, last).1
}

fn indices(effects: &[Effect<u64>]) -> Vec<usize> {
    effects
        .iter()
        .filter_map(|e| match e {
            Effect::Commit { index, .. } => Some(*index),
            _ => None,
        })
        .collect()
}

#[test]
fn a_handoff_reads_the_text_in_the_receivers_vocabulary_and_rolls_its_kv_back() {
    let Some(spellings) = real_spellings() else {
        return;
    };
    let [smol, gemma] = spellings;
    let (mut kv0, mut kv1) = (KvStore::new(4096), KvStore::new(4096));
    let mut m0 = scheduler(ExecutionMode::Tokenrouter);
    let mut m1 = ModelScheduler::new(
        1,
        2,
        "m1",
        ExecutionMode::Tokenrouter,
        StepLimits::unlimited(),
    );
    m0.admit(&mut kv0, cross_request(spellings, 64), true);

    // SmolLM2 writes "The capital of Jap" and hands over inside the word.
    let written = smol.encode("The capital of Jap").unwrap();
    let effects = write(&mut m0, &mut kv0, &written, Route::CommitThenSwitch(1));
    let to_gemma = handed_off(effects);
    let mut expected = GEMMA_PROMPT.to_vec();
    expected.extend(gemma.encode("The capital of Jap").unwrap());
    assert_eq!(
        to_gemma.state.tokens, expected,
        "Gemma's prompt and its reading"
    );
    assert_eq!(to_gemma.state.prompt_len, GEMMA_PROMPT.len());
    assert_eq!(to_gemma.handoff.as_ref().unwrap().tokens, expected);

    m1.admit(&mut kv1, to_gemma, true);
    let gemma_part = gemma.encode("an is Tokyo").unwrap();
    let (work, _) = step_one(&mut m1, &mut kv1, gemma_part[0], Route::Stay);
    assert_eq!(work[0].tokens, expected, "Gemma reads it all");
    let effects = write(
        &mut m1,
        &mut kv1,
        &gemma_part[1..],
        Route::CommitThenSwitch(0),
    );
    let back = handed_off(effects);

    // SmolLM2 keeps its tokens up to the space before "Jap", and re-reads " Japan is Tokyo".
    let before_word = smol.encode("The capital of").unwrap();
    let kept = SMOL_PROMPT.len() + before_word.len();
    assert_eq!(back.state.seen[0], kept);
    let mut smol_tokens = SMOL_PROMPT.to_vec();
    smol_tokens.extend(&before_word);
    smol_tokens.extend(smol.encode(" Japan is Tokyo").unwrap());
    assert_eq!(back.state.tokens, smol_tokens);
    let seq = m0.seqs[&RequestId(1)];
    assert!(
        kv0.seq_len(seq) > kept,
        "its KV still holds the word it wrote"
    );
    m0.admit(&mut kv0, back, true);
    assert_eq!(kv0.seq_len(seq), kept, "rolled back to the stable boundary");
    let (work, effects) = step_one(&mut m0, &mut kv0, smol.encode(".").unwrap()[0], Route::Stay);
    assert_eq!(work[0].seq, seq, "the same sequence resumes");
    assert_eq!(work[0].tokens, smol_tokens[kept..], "only the re-read tail");
    // Counted in committed tokens, whoever wrote them.
    let committed_so_far = written.len() + gemma_part.len();
    assert_eq!(indices(&effects), [committed_so_far]);
}

#[test]
fn a_handoff_waits_for_a_whole_character_and_a_rejected_candidate_is_never_half_committed() {
    let Some(spellings) = real_spellings() else {
        return;
    };
    let [smol, gemma] = spellings;
    let byte_token = |byte: u8| {
        (0..smol.words().len() as u32)
            .find(|&t| smol.bytes(t) == [byte])
            .expect("byte-level BPE spells every byte")
    };
    let (mut kv0, mut kv1) = (KvStore::new(4096), KvStore::new(4096));
    let mut m0 = scheduler(ExecutionMode::Async);
    let mut m1 = ModelScheduler::new(1, 2, "m1", ExecutionMode::Async, StepLimits::unlimited());
    m0.admit(&mut kv0, cross_request(spellings, 64), true);
    let tokyo = smol.encode("Tokyo").unwrap();
    let effects = write(&mut m0, &mut kv0, &tokyo, Route::Stay);
    assert!(committed(&effects).len() == 1 && m0.resident() == 1);

    // "東" is E6 9D B1: after its first byte neither route may leave.
    let [b0, b1, b2] = "東".as_bytes().try_into().unwrap();
    let (_, effects) = step_one(
        &mut m0,
        &mut kv0,
        byte_token(b0),
        Route::CommitThenSwitch(1),
    );
    assert_eq!(committed(&effects), [(1, byte_token(b0))]);
    assert_eq!(m0.resident(), 1, "stays inside the character");
    // A rejection there would leave the text broken: the candidate is kept instead.
    let (_, effects) = step_one(&mut m0, &mut kv0, byte_token(b1), Route::RejectAndSwitch(1));
    assert_eq!(committed(&effects), [(1, byte_token(b1))]);
    assert_eq!(m0.resident(), 1);
    let (_, effects) = step_one(
        &mut m0,
        &mut kv0,
        byte_token(b2),
        Route::CommitThenSwitch(1),
    );
    let to_gemma = handed_off(effects);
    assert_eq!(
        gemma.spell(&to_gemma.state.tokens[GEMMA_PROMPT.len()..]),
        "Tokyo東".as_bytes()
    );

    // Gemma's candidate is rejected at a whole character: only the text so far goes back.
    m1.admit(&mut kv1, to_gemma, true);
    let rejected = gemma.encode("京").unwrap()[0];
    let (_, effects) = step_one(&mut m1, &mut kv1, rejected, Route::RejectAndSwitch(0));
    assert!(committed(&effects).is_empty());
    let back = handed_off(effects);
    assert_eq!(
        smol.spell(&back.state.tokens[SMOL_PROMPT.len()..]),
        "Tokyo東".as_bytes()
    );
    assert_eq!(back.completion_tokens(), tokyo.len() + 3);
    // Its own end-of-sequence ends it, counted as a stop.
    m0.admit(&mut kv0, back, true);
    let (_, effects) = step_one(&mut m0, &mut kv0, SMOL_EOS, Route::Stay);
    assert_eq!(
        finish(&effects),
        Some((FinishReason::Stop, SMOL_PROMPT.len(), tokyo.len() + 3))
    );
}

#[test]
fn max_tokens_and_the_end_count_committed_tokens_in_the_writers_vocabulary() {
    let Some(spellings) = real_spellings() else {
        return;
    };
    let [smol, gemma] = spellings;
    let (mut kv0, mut kv1) = (KvStore::new(4096), KvStore::new(4096));
    let mut m0 = scheduler(ExecutionMode::Standard);
    let mut m1 = ModelScheduler::new(1, 2, "m1", ExecutionMode::Standard, StepLimits::unlimited());
    m0.admit(&mut kv0, cross_request(spellings, 5), true);
    let effects = write(
        &mut m0,
        &mut kv0,
        &smol.encode(" one two").unwrap(),
        Route::CommitThenSwitch(1),
    );
    let moved = handed_off(effects);
    assert_eq!(moved.completion_tokens(), 2);
    m1.admit(&mut kv1, moved, true);
    // SmolLM2's end-of-sequence id means nothing to Gemma; Gemma's own ends the request.
    let (_, effects) = step_one(&mut m1, &mut kv1, SMOL_EOS, Route::Stay);
    assert_eq!(committed(&effects), [(1, SMOL_EOS)]);
    let (_, effects) = step_one(
        &mut m1,
        &mut kv1,
        gemma.encode(" three").unwrap()[0],
        Route::Stay,
    );
    assert_eq!(indices(&effects), [3]);
    let (_, effects) = step_one(
        &mut m1,
        &mut kv1,
        gemma.encode(" four").unwrap()[0],
        Route::Stay,
    );
    assert_eq!(
        finish(&effects),
        Some((FinishReason::Length, SMOL_PROMPT.len(), 5))
    );
}

fn finish(effects: &[Effect<u64>]) -> Option<(FinishReason, usize, usize)> {
    effects.iter().find_map(|e| match e {
        Effect::Finish {
            reason,
            prompt_tokens,
            completion_tokens,
            ..
        } => Some((*reason, *prompt_tokens, *completion_tokens)),
        _ => None,
    })
}
