//! A request's tokens back in completion order. In one process they reach the client in
//! order (one mailbox); across processes a handoff can reach the next model, and that
//! model's tokens the client, before the last tokens the sender streamed, which travel on
//! another subject. So every token carries its index, and the end waits for the count it
//! names.

use std::collections::BTreeMap;

/// Tokens `T` and an end `E`, released in order.
pub(crate) struct StreamOrder<T, E> {
    next: usize,
    early: BTreeMap<usize, T>,
    /// An end that overtook some of its tokens, with how many it counts.
    end: Option<(usize, E)>,
}

/// What may go to the client now.
pub(crate) struct Released<T, E> {
    pub tokens: Vec<T>,
    pub end: Option<E>,
}

impl<T, E> Default for StreamOrder<T, E> {
    fn default() -> Self {
        Self {
            next: 0,
            early: BTreeMap::new(),
            end: None,
        }
    }
}

impl<T, E> StreamOrder<T, E> {
    /// Token `index` arrived; a repeated index is dropped.
    pub fn token(&mut self, index: usize, token: T) -> Released<T, E> {
        if index >= self.next {
            self.early.entry(index).or_insert(token);
        }
        self.release()
    }

    /// The end arrived, after `tokens` tokens in all.
    pub fn end(&mut self, tokens: usize, end: E) -> Released<T, E> {
        self.end = Some((tokens, end));
        self.release()
    }

    /// Whether an end waits for tokens that have not arrived.
    pub fn waiting(&self) -> bool {
        self.end.is_some()
    }

    /// The index of the first token not yet released.
    pub fn next(&self) -> usize {
        self.next
    }

    fn release(&mut self) -> Released<T, E> {
        let mut tokens = Vec::new();
        while let Some(token) = self.early.remove(&self.next) {
            tokens.push(token);
            self.next += 1;
        }
        let end = match self.end.take() {
            Some((count, end)) if self.next >= count => Some(end),
            waiting => {
                self.end = waiting;
                None
            }
        };
        Released { tokens, end }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_in_order_pass_straight_through() {
        let mut order = StreamOrder::<char, &str>::default();
        assert_eq!(order.token(0, 'a').tokens, ['a']);
        assert_eq!(order.token(1, 'b').tokens, ['b']);
        let done = order.end(2, "stop");
        assert_eq!((done.tokens.len(), done.end), (0, Some("stop")));
    }

    /// The handoff's next model streamed tokens 2 and 3, and the end, before the sender's 1.
    #[test]
    fn overtaking_tokens_and_end_wait_for_the_missing_one() {
        let mut order = StreamOrder::<char, &str>::default();
        assert_eq!(order.token(0, 'a').tokens, ['a']);
        assert!(order.token(2, 'c').tokens.is_empty());
        assert!(order.token(3, 'd').tokens.is_empty());
        let early_end = order.end(4, "length");
        assert!(early_end.tokens.is_empty() && early_end.end.is_none());
        assert!(order.waiting());
        assert_eq!(order.next(), 1);
        let done = order.token(1, 'b');
        assert_eq!(
            (done.tokens, done.end),
            (vec!['b', 'c', 'd'], Some("length"))
        );
        assert!(!order.waiting());
    }

    #[test]
    fn a_repeated_token_is_dropped() {
        let mut order = StreamOrder::<char, ()>::default();
        order.token(0, 'a');
        assert!(order.token(0, 'x').tokens.is_empty());
        assert!(order.token(2, 'c').tokens.is_empty());
        assert!(order.token(2, 'y').tokens.is_empty());
        assert_eq!(order.token(1, 'b').tokens, ['b', 'c']);
    }
}
