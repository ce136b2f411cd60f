//! Tokens' bytes to text deltas for streaming: a token may end in the middle of a UTF-8
//! character (its rest is held back until a later token completes it), and stop sequences
//! (text that could still become a stop sequence is held back). Working on each token's bytes
//! in its own vocabulary, not on ids, it reads a generation whichever models wrote it.

use crate::engine::shared_text::incomplete_tail;

pub struct TextStream {
    /// Bytes of a character not yet complete.
    pending: Vec<u8>,
    tokens: usize,
    /// All text produced so far; `text[..emitted]` went to the client.
    text: String,
    emitted: usize,
    stop: Vec<String>,
    stopped: bool,
}

impl TextStream {
    pub fn new(stop: Vec<String>) -> Self {
        Self {
            pending: Vec::new(),
            tokens: 0,
            text: String::new(),
            emitted: 0,
            stop,
            stopped: false,
        }
    }

    /// Adds a token's bytes; returns the text that can be sent now. After a stop sequence
    /// matched, `stopped()` is true and further tokens add nothing.
    pub fn push(&mut self, bytes: &[u8]) -> String {
        if self.stopped {
            return String::new();
        }
        self.tokens += 1;
        self.pending.extend_from_slice(bytes);
        let whole = self.pending.len() - incomplete_tail(&self.pending);
        // Bytes that can never form a character read as U+FFFD, as a tokenizer decodes them.
        self.text
            .push_str(&String::from_utf8_lossy(&self.pending[..whole]));
        self.pending.drain(..whole);
        self.release(false)
    }

    /// The text still held back, at the end of the generation.
    pub fn finish(&mut self) -> String {
        if !self.stopped && !self.pending.is_empty() {
            self.text.push_str(&String::from_utf8_lossy(&self.pending));
            self.pending.clear();
        }
        self.release(true)
    }

    pub fn stopped(&self) -> bool {
        self.stopped
    }

    /// Tokens consumed (the ones past a stop sequence are not).
    pub fn tokens(&self) -> usize {
        self.tokens
    }

    fn release(&mut self, at_end: bool) -> String {
        if self.stopped {
            return String::new();
        }
        let longest = self.stop.iter().map(String::len).max().unwrap_or(0);
        let mut from = self.emitted.saturating_sub(longest);
        while !self.text.is_char_boundary(from) {
            from -= 1;
        }
        let hit = self
            .stop
            .iter()
            .filter_map(|s| self.text[from..].find(s.as_str()).map(|i| from + i))
            .min();
        let end = match hit {
            Some(at) => {
                self.stopped = true;
                self.text.truncate(at);
                at
            }
            None if at_end => self.text.len(),
            None => self.text.len() - self.partial_stop_suffix(),
        };
        let end = end.max(self.emitted);
        let out = self.text[self.emitted..end].to_string();
        self.emitted = end;
        out
    }

    /// Length of the longest end of the text that begins some stop sequence.
    fn partial_stop_suffix(&self) -> usize {
        self.stop
            .iter()
            .flat_map(|s| {
                (1..s.len())
                    .filter(|&n| s.is_char_boundary(n))
                    .filter(|&n| self.text.ends_with(&s[..n]))
            })
            .max()
            .unwrap_or(0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The text fed one byte per token.
    fn run(text: &str, stop: &[&str]) -> (Vec<String>, String, bool) {
        let mut stream = TextStream::new(stop.iter().map(|s| s.to_string()).collect());
        let mut deltas: Vec<String> = text.bytes().map(|b| stream.push(&[b])).collect();
        deltas.push(stream.finish());
        let joined = deltas.concat();
        (deltas, joined, stream.stopped())
    }

    #[test]
    fn multibyte_characters_are_sent_whole() {
        let (deltas, joined, stopped) = run("né 東京", &[]);
        assert_eq!(joined, "né 東京");
        assert!(!stopped);
        assert!(deltas.iter().all(|d| !d.contains('\u{FFFD}')));
        // "東" is 3 bytes: two empty deltas, then the character.
        assert_eq!(&deltas[4..7], ["", "", "東"]);
    }

    #[test]
    fn stop_sequence_across_tokens_is_cut_and_never_sent() {
        let (deltas, joined, stopped) = run("Hello\n\nUser: more", &["\n\nUser:"]);
        assert_eq!(joined, "Hello");
        assert!(stopped);
        assert!(deltas.iter().all(|d| !d.contains('\n')));
    }

    #[test]
    fn held_back_text_that_does_not_stop_is_released() {
        let (deltas, joined, stopped) = run("a\n\nb", &["\n\nUser:"]);
        assert_eq!(joined, "a\n\nb");
        assert!(!stopped);
        // The newlines wait until "b" shows they do not start the stop sequence.
        assert_eq!(deltas[1], "");
        assert_eq!(deltas[3], "\n\nb");
    }

    #[test]
    fn earliest_of_several_stop_sequences_wins() {
        let (_, joined, stopped) = run("one two three", &["three", "two"]);
        assert_eq!(joined, "one ");
        assert!(stopped);
    }

    #[test]
    fn a_character_left_unfinished_or_broken_reads_as_a_replacement() {
        let mut stream = TextStream::new(Vec::new());
        assert_eq!(stream.push(b"a\xff"), "a\u{FFFD}");
        assert_eq!(stream.push(&"東".as_bytes()[..2]), "");
        assert_eq!(stream.finish(), "\u{FFFD}");
        assert_eq!(stream.tokens(), 2);
    }
}
