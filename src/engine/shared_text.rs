//! A generation shared by models with different vocabularies. What they share is the
//! committed text: each model keeps its own token stream, and a model that takes over
//! re-reads the text it has not seen in its own vocabulary.
//!
//! Tokenization does not compose at arbitrary points (a word split across a handoff reads
//! differently than whole), so the receiver drops its tokens back to its last *stable
//! boundary* — the end of one of its tokens where the text turns from a non-space to a space,
//! where both byte-level BPE's pre-tokenizer and SentencePiece's pieces split — and
//! re-tokenizes everything from there. Its KV is rolled back to the same point. A handoff
//! waits while the text ends inside a UTF-8 character (a byte token wrote part of one): the
//! receiver could not read it, and no client ever sees a broken character.
//!
//! Models are numbered as the runtime numbers them; models of one vocabulary may share a
//! number here (they read the same tokens).

use super::spelling::Spelling;
use crate::error::EngineResult;

type ModelIdx = usize;

/// One model's tokens of the generated text, with the byte offset each one ends at.
#[derive(Debug, Clone, Default)]
struct Stream {
    tokens: Vec<u32>,
    ends: Vec<usize>,
}

impl Stream {
    /// Bytes of the text these tokens spell.
    fn spelled(&self) -> usize {
        self.ends.last().copied().unwrap_or(0)
    }

    /// Byte offset after the first `kept` tokens.
    fn end_of(&self, kept: usize) -> usize {
        kept.checked_sub(1).map_or(0, |i| self.ends[i])
    }

    fn truncate(&mut self, kept: usize) {
        self.tokens.truncate(kept);
        self.ends.truncate(kept);
    }

    fn push(&mut self, token: u32, end: usize) {
        self.tokens.push(token);
        self.ends.push(end);
    }
}

/// What a model must do to read the whole committed text: keep the first `kept` of its
/// generated tokens (its KV after its prompt rolls back to them), then take `append`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Resync {
    pub kept: usize,
    pub append: Vec<u32>,
}

/// The committed text of one request and every model's tokens of it.
#[derive(Debug, Clone)]
pub struct SharedText {
    text: Vec<u8>,
    streams: Vec<Stream>,
}

impl SharedText {
    pub fn new(models: usize) -> Self {
        Self {
            text: Vec::new(),
            streams: vec![Stream::default(); models],
        }
    }

    /// The committed text's bytes.
    pub fn text(&self) -> &[u8] {
        &self.text
    }

    /// `model`'s generated tokens, which spell a prefix of the text (all of it while it
    /// serves).
    pub fn tokens(&self, model: ModelIdx) -> &[u32] {
        &self.streams[model].tokens
    }

    /// Commits `token` from `model`, which serves and has read the whole text.
    pub fn commit(&mut self, model: ModelIdx, token: u32, spelling: &Spelling) {
        let stream = &mut self.streams[model];
        debug_assert_eq!(stream.spelled(), self.text.len(), "model {model} is behind");
        self.text.extend_from_slice(spelling.bytes(token));
        stream.push(token, self.text.len());
    }

    /// Whether the text ends on a whole character, so another model may take over.
    pub fn at_char_boundary(&self) -> bool {
        incomplete_tail(&self.text) == 0
    }

    /// Brings `model`'s tokens up to the whole text (`at_char_boundary` must hold): the
    /// tokens after its last stable boundary are dropped and the text from there is read in
    /// its vocabulary.
    pub fn resync(&mut self, model: ModelIdx, spelling: &Spelling) -> EngineResult<Resync> {
        debug_assert!(self.at_char_boundary(), "a handoff inside a character");
        let stream = &mut self.streams[model];
        if stream.spelled() == self.text.len() {
            return Ok(Resync {
                kept: stream.tokens.len(),
                append: Vec::new(),
            });
        }
        let kept = (0..=stream.tokens.len())
            .rev()
            .find(|&kept| is_stable_boundary(&self.text, stream.end_of(kept)))
            .unwrap_or(0);
        let from = stream.end_of(kept);
        let rest = std::str::from_utf8(&self.text[from..])
            .expect("stable boundaries lie between whole characters of whole text");
        let append = spelling.encode(rest)?;
        stream.truncate(kept);
        let mut end = from;
        for &token in &append {
            end += spelling.bytes(token).len();
            stream.push(token, end);
        }
        debug_assert_eq!(end, self.text.len());
        Ok(Resync { kept, append })
    }
}

/// Where a token may end so that reading on from there splits as reading the whole would:
/// the start of the text, or a space after a non-space.
fn is_stable_boundary(text: &[u8], at: usize) -> bool {
    let space = |b: u8| b.is_ascii_whitespace();
    at == 0 || (at < text.len() && space(text[at]) && !space(text[at - 1]))
}

/// Bytes at the end of `text` that start a UTF-8 character without finishing it.
pub fn incomplete_tail(text: &[u8]) -> usize {
    // A character is at most 4 bytes: find the last lead byte among the last 4.
    for back in 1..=text.len().min(4) {
        let byte = text[text.len() - back];
        let width = match byte {
            0x00..=0x7F => 1,
            0xC0..=0xDF => 2,
            0xE0..=0xEF => 3,
            0xF0..=0xF7 => 4,
            _ => continue,
        };
        return if back < width { back } else { 0 };
    }
    0
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::spelling::real_spellings;

    #[test]
    fn an_unfinished_character_is_found_at_the_end_only() {
        let text = "aé東🎉".as_bytes();
        assert_eq!(incomplete_tail(text), 0);
        for cut in 1..text.len() {
            let whole = std::str::from_utf8(&text[..cut]).is_ok();
            assert_eq!(incomplete_tail(&text[..cut]) == 0, whole, "cut at {cut}");
        }
        assert_eq!(incomplete_tail(&"🎉".as_bytes()[..3]), 3);
    }

    #[test]
    fn stable_boundaries_sit_before_a_space_that_follows_a_word() {
        let text = b"ab  cd\nef";
        let stable: Vec<usize> = (0..=text.len())
            .filter(|&at| is_stable_boundary(text, at))
            .collect();
        assert_eq!(stable, [0, 2, 6]);
    }

    const TEXTS: [&str; 8] = [
        "The capital of Japan is Tokyo. It has 13,960,000 people (2021).",
        "def add(a, b):\n    return a + b  # sum of two numbers\n\n\tprint(add(1, 2))",
        "日本の首都は東京です。中文文本，한국어 텍스트, Ελληνικά, Русский текст.",
        "Emoji: 🎉🚀👩‍👩‍👧‍👦 🇯🇵 ❤️ and rare ones: 🧬 𪛖 அ.",
        "  spaced   out  words, tabs\tand\r\nline ends  ",
        "3.14159 2718281828 1e-9 0x1F -42 1,000,000 ½ ⅞ ٣",
        "naïve façade in Zürich; <div class=\"x\">markup</div> and <end_of_turn> as text ▁",
        "{\"answer\": \"Tokyo\", \"confidence\": 97, \"tags\": [\"city\", \"asia\"]}",
    ];

    /// Two models write `text` in turn, each in its own tokens, the serving one changing
    /// where `switches` says (a switch waits while the text ends inside a character).
    /// Returns the shared text's state at the end; panics where an invariant breaks.
    fn write_in_turns(
        spellings: &[std::sync::Arc<Spelling>; 2],
        text: &str,
        switches: &[bool],
    ) -> SharedText {
        let mut shared = SharedText::new(2);
        let mut serving = 0;
        let mut plan = spellings[serving].encode(text).unwrap().into_iter();
        let mut steps = 0;
        while shared.text().len() < text.len() {
            let token = plan.next().expect("the plan spells the text");
            shared.commit(serving, token, &spellings[serving]);
            assert!(text.as_bytes().starts_with(shared.text()));
            steps += 1;
            let wanted = switches[steps % switches.len()];
            if !wanted || !shared.at_char_boundary() || shared.text().len() == text.len() {
                continue;
            }
            let next = 1 - serving;
            let before = shared.tokens(next).to_vec();
            let resync = shared.resync(next, &spellings[next]).unwrap();
            assert!(resync.kept <= before.len());
            assert_eq!(shared.tokens(next)[..resync.kept], before[..resync.kept]);
            assert_eq!(shared.tokens(next)[resync.kept..], resync.append[..]);
            assert_eq!(spellings[next].spell(shared.tokens(next)), shared.text());
            serving = next;
            let rest = std::str::from_utf8(&text.as_bytes()[shared.text().len()..]).unwrap();
            plan = spellings[serving].encode(rest).unwrap().into_iter();
        }
        shared
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(48))]

        /// Whatever the handoff points, the committed text is the text written (no character
        /// lost, duplicated or broken), and each model's tokens spell it once it catches up.
        #[test]
        fn handoffs_between_two_real_vocabularies_keep_the_text(
            pick in proptest::collection::vec(0..TEXTS.len(), 1..4),
            switches in proptest::collection::vec(proptest::bool::weighted(0.3), 1..24),
        ) {
            let Some(spellings) = real_spellings() else {
                return Ok(());
            };
            let text: String = pick.iter().map(|&i| TEXTS[i]).collect::<Vec<_>>().join(" ");
            let mut shared = write_in_turns(spellings, &text, &switches);
            proptest::prop_assert_eq!(shared.text(), text.as_bytes());
            for (model, spelling) in spellings.iter().enumerate() {
                shared.resync(model, spelling).unwrap();
                proptest::prop_assert_eq!(spelling.spell(shared.tokens(model)), text.as_bytes());
            }
        }
    }

    /// A model whose tokens end between words keeps them all; one whose last token ended
    /// inside a word drops back to the space before that word.
    #[test]
    fn a_resync_keeps_tokens_up_to_the_last_stable_boundary() {
        let Some(spellings) = real_spellings() else {
            return;
        };
        let mut shared = SharedText::new(2);
        let [smol, gemma] = spellings;
        let written = smol.encode("The capital of Jap").unwrap();
        let before_word = smol.encode("The capital of").unwrap();
        assert!(written.starts_with(&before_word) && written.len() > before_word.len());
        for &token in &written {
            shared.commit(0, token, smol);
        }
        assert!(shared.resync(0, smol).unwrap().append.is_empty());
        let first = shared.resync(1, gemma).unwrap();
        assert_eq!(first.kept, 0);
        assert_eq!(first.append, gemma.encode("The capital of Jap").unwrap());
        // Gemma finishes the word: SmolLM re-reads " Japan ..." whole.
        for token in gemma.encode("an is Tokyo").unwrap() {
            shared.commit(1, token, gemma);
        }
        let second = shared.resync(0, smol).unwrap();
        assert_eq!(second.kept, before_word.len());
        assert_eq!(second.append, smol.encode(" Japan is Tokyo").unwrap());
        // Gemma's tokens end on a word: it keeps them all.
        let gemma_tokens = shared.tokens(1).len();
        for token in smol.encode(" and").unwrap() {
            shared.commit(0, token, smol);
        }
        let third = shared.resync(1, gemma).unwrap();
        assert_eq!(third.kept, gemma_tokens);
        assert_eq!(gemma.spell(&third.append), b" and");
    }
}
