//! Token ids to text deltas for streaming: incremental detokenization (a token may end in
//! the middle of a UTF-8 character, and a tokenizer may change earlier text when more ids
//! follow), and stop sequences (text that could still become a stop sequence is held back).

/// Ids decoded behind the newest one, so context-dependent decoders see their context.
const DECODE_CONTEXT: usize = 5;

pub struct TextStream<D> {
    decode: D,
    ids: Vec<u32>,
    /// `ids[prefix..read]` is decoded context already turned into text.
    prefix: usize,
    read: usize,
    /// All text produced so far; `text[..emitted]` went to the client.
    text: String,
    emitted: usize,
    stop: Vec<String>,
    stopped: bool,
}

impl<D: Fn(&[u32]) -> String> TextStream<D> {
    pub fn new(decode: D, stop: Vec<String>) -> Self {
        Self {
            decode,
            ids: Vec::new(),
            prefix: 0,
            read: 0,
            text: String::new(),
            emitted: 0,
            stop,
            stopped: false,
        }
    }

    /// Adds a token; returns the text that can be sent now. After a stop sequence matched,
    /// `stopped()` is true and further tokens add nothing.
    pub fn push(&mut self, id: u32) -> String {
        if self.stopped {
            return String::new();
        }
        self.ids.push(id);
        let before = (self.decode)(&self.ids[self.prefix..self.read]);
        let after = (self.decode)(&self.ids[self.prefix..]);
        if after.ends_with('\u{FFFD}') {
            return String::new();
        }
        if let Some(new) = after
            .get(before.len()..)
            .filter(|_| after.starts_with(&before))
        {
            self.text.push_str(new);
            self.read = self.ids.len();
            self.prefix = self.read.saturating_sub(DECODE_CONTEXT);
        }
        self.release(false)
    }

    /// The text still held back, at the end of the generation.
    pub fn finish(&mut self) -> String {
        if !self.stopped && self.read < self.ids.len() {
            let before = (self.decode)(&self.ids[self.prefix..self.read]);
            let after = (self.decode)(&self.ids[self.prefix..]);
            if let Some(new) = after.get(before.len()..) {
                self.text.push_str(new);
            }
            self.read = self.ids.len();
        }
        self.release(true)
    }

    pub fn stopped(&self) -> bool {
        self.stopped
    }

    /// Tokens consumed (the ones past a stop sequence are not).
    pub fn tokens(&self) -> usize {
        self.ids.len()
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

    /// A toy byte-level decoder: ids are bytes; incomplete UTF-8 decodes to U+FFFD.
    fn bytes(ids: &[u32]) -> String {
        String::from_utf8_lossy(&ids.iter().map(|&b| b as u8).collect::<Vec<_>>()).into_owned()
    }

    fn run(text: &str, stop: &[&str]) -> (Vec<String>, String, bool) {
        let mut stream = TextStream::new(bytes, stop.iter().map(|s| s.to_string()).collect());
        let mut deltas: Vec<String> = text.bytes().map(|b| stream.push(b as u32)).collect();
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
}
