//! A step's small integer inputs (token ids, positions, KV slots, block tables) packed into
//! one array, so that a GPU takes them in one copy, and the fixed layout a captured decode
//! graph reads them in: the batch padded to a bucket of rows, each row's block table at a
//! fixed width. Plain data, so the bucketing and the padding are tested without a GPU.

use super::kv::{BlockId, BLOCK_TOKENS};

/// Row counts a decode graph is captured for; a batch runs in the smallest that holds it.
pub const DECODE_BUCKETS: [usize; 7] = [1, 2, 4, 8, 16, 32, 64];

/// The KV slot of a padding row: the cache write skips it.
pub const PADDING_SLOT: i32 = -1;

/// The smallest decode bucket holding `rows` rows; `None` past the largest (run eagerly).
pub fn decode_bucket(rows: usize) -> Option<usize> {
    DECODE_BUCKETS.iter().copied().find(|&b| b >= rows.max(1))
}

/// The cache slot (row of a layer's cache) of `position` in a sequence whose blocks are
/// `table`.
pub fn slot(table: &[BlockId], position: usize) -> i32 {
    (table[position / BLOCK_TOKENS] as usize * BLOCK_TOKENS + position % BLOCK_TOKENS) as i32
}

/// Where each part lies in a packed array: `rows` token ids, `rows` positions, `rows` slots,
/// `rows` table offsets, then `table_len` block ids.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct InputsLayout {
    pub rows: usize,
    pub table_len: usize,
}

impl InputsLayout {
    pub fn len(&self) -> usize {
        4 * self.rows + self.table_len
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub fn tokens(&self) -> std::ops::Range<usize> {
        0..self.rows
    }

    pub fn positions(&self) -> std::ops::Range<usize> {
        self.rows..2 * self.rows
    }

    pub fn slots(&self) -> std::ops::Range<usize> {
        2 * self.rows..3 * self.rows
    }

    /// Per row: where its sequence's block table starts in the block tables.
    pub fn row_tables(&self) -> std::ops::Range<usize> {
        3 * self.rows..4 * self.rows
    }

    pub fn block_tables(&self) -> std::ops::Range<usize> {
        4 * self.rows..self.len()
    }
}

/// One sequence's new rows in a step.
#[derive(Debug, Clone, Copy)]
pub struct SequenceRows<'a> {
    pub tokens: &'a [u32],
    /// The position of `tokens[0]`.
    pub first_position: usize,
    /// The sequence's KV blocks, covering every position up to its last new row.
    pub table: &'a [BlockId],
}

/// A step's inputs in one array, described by `layout`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StepInputs {
    pub packed: Vec<i32>,
    pub layout: InputsLayout,
}

impl StepInputs {
    /// Every row of every sequence, the block tables back to back.
    pub fn eager(sequences: &[SequenceRows]) -> Self {
        let rows = sequences.iter().map(|s| s.tokens.len()).sum();
        let table_len = sequences.iter().map(|s| s.table.len()).sum();
        let mut inputs = Self::empty(InputsLayout { rows, table_len });
        let (mut row, mut table_start) = (0, 0);
        for s in sequences {
            inputs.put_sequence(row, table_start, s);
            row += s.tokens.len();
            table_start += s.table.len();
        }
        inputs
    }

    /// One row per sequence (each one token), padded to `bucket` rows, row `i`'s block table
    /// at `i · table_width`: the layout of a decode graph captured for `bucket` rows.
    /// `None` where the step does not fit it (a sequence with several rows, more sequences
    /// than `bucket`, or a table wider than `table_width`).
    pub fn decode(sequences: &[SequenceRows], bucket: usize, table_width: usize) -> Option<Self> {
        let fits = sequences.len() <= bucket
            && sequences
                .iter()
                .all(|s| s.tokens.len() == 1 && s.table.len() <= table_width);
        if !fits {
            return None;
        }
        let layout = InputsLayout {
            rows: bucket,
            table_len: bucket * table_width,
        };
        let mut inputs = Self::empty(layout);
        for (row, start) in inputs.packed[layout.row_tables()].iter_mut().enumerate() {
            *start = (row * table_width) as i32;
        }
        for (row, s) in sequences.iter().enumerate() {
            inputs.put_sequence(row, row * table_width, s);
        }
        Some(inputs)
    }

    /// Every row padding (token 0 at position 0, no KV write, block 0 in its table): what a
    /// row no sequence fills reads, so its results are discarded.
    fn empty(layout: InputsLayout) -> Self {
        let mut packed = vec![0; layout.len()];
        packed[layout.slots()].fill(PADDING_SLOT);
        Self { packed, layout }
    }

    fn put_sequence(&mut self, first_row: usize, table_start: usize, s: &SequenceRows) {
        let layout = self.layout;
        let tables = &mut self.packed[layout.block_tables()];
        for (dst, &block) in tables[table_start..].iter_mut().zip(s.table) {
            *dst = block as i32;
        }
        for (i, &token) in s.tokens.iter().enumerate() {
            let (row, position) = (first_row + i, s.first_position + i);
            self.packed[layout.tokens()][row] = token as i32;
            self.packed[layout.positions()][row] = position as i32;
            self.packed[layout.slots()][row] = slot(s.table, position);
            self.packed[layout.row_tables()][row] = table_start as i32;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rows<'a>(
        tokens: &'a [u32],
        first_position: usize,
        table: &'a [BlockId],
    ) -> SequenceRows<'a> {
        SequenceRows {
            tokens,
            first_position,
            table,
        }
    }

    #[test]
    fn buckets_are_the_smallest_that_hold_the_rows() {
        assert_eq!(decode_bucket(0), Some(1));
        assert_eq!(decode_bucket(1), Some(1));
        assert_eq!(decode_bucket(3), Some(4));
        assert_eq!(decode_bucket(8), Some(8));
        assert_eq!(decode_bucket(33), Some(64));
        assert_eq!(decode_bucket(64), Some(64));
        assert_eq!(decode_bucket(65), None);
    }

    #[test]
    fn eager_inputs_put_each_sequence_rows_and_table_back_to_back() {
        // A prompt of 3 tokens from position 15 (crossing into its second block) and one
        // decode row at position 40 of a three-block sequence.
        let inputs =
            StepInputs::eager(&[rows(&[7, 8, 9], 15, &[4, 2]), rows(&[5], 40, &[0, 3, 6])]);
        let l = inputs.layout;
        assert_eq!(
            l,
            InputsLayout {
                rows: 4,
                table_len: 5
            }
        );
        let p = &inputs.packed;
        assert_eq!(p[l.tokens()], [7, 8, 9, 5]);
        assert_eq!(p[l.positions()], [15, 16, 17, 40]);
        let block = BLOCK_TOKENS as i32;
        assert_eq!(
            p[l.slots()],
            [4 * block + 15, 2 * block, 2 * block + 1, 6 * block + 8]
        );
        assert_eq!(p[l.row_tables()], [0, 0, 0, 2]);
        assert_eq!(p[l.block_tables()], [4, 2, 0, 3, 6]);
    }

    #[test]
    fn decode_inputs_pad_to_the_bucket_with_rows_that_write_no_kv() {
        let inputs =
            StepInputs::decode(&[rows(&[11], 3, &[9]), rows(&[12], 20, &[1, 5])], 4, 3).unwrap();
        let l = inputs.layout;
        assert_eq!(
            l,
            InputsLayout {
                rows: 4,
                table_len: 12
            }
        );
        let p = &inputs.packed;
        let block = BLOCK_TOKENS as i32;
        assert_eq!(p[l.tokens()], [11, 12, 0, 0]);
        assert_eq!(p[l.positions()], [3, 20, 0, 0]);
        assert_eq!(
            p[l.slots()],
            [9 * block + 3, 5 * block + 4, PADDING_SLOT, PADDING_SLOT]
        );
        assert_eq!(p[l.row_tables()], [0, 3, 6, 9]);
        assert_eq!(p[l.block_tables()], [9, 0, 0, 1, 5, 0, 0, 0, 0, 0, 0, 0]);
    }

    #[test]
    fn a_padded_decode_row_reads_what_it_would_read_unpadded() {
        // The same sequence as row 0 of a 1-row step and of an 8-row bucket: same token,
        // position, slot and table.
        let table = [3, 1, 4];
        let sequences = [rows(&[42], 35, &table)];
        let eager = StepInputs::eager(&sequences);
        let padded = StepInputs::decode(&sequences, 8, 4).unwrap();
        let (e, d) = (eager.layout, padded.layout);
        for (a, b) in [
            (e.tokens(), d.tokens()),
            (e.positions(), d.positions()),
            (e.slots(), d.slots()),
        ] {
            assert_eq!(eager.packed[a.start], padded.packed[b.start]);
        }
        let start = padded.packed[d.row_tables().start] as usize;
        let tables = &padded.packed[d.block_tables()];
        assert_eq!(&tables[start..start + 3], &eager.packed[e.block_tables()]);
    }

    #[test]
    fn steps_that_do_not_fit_a_decode_graph_are_refused() {
        let table = [1, 2];
        // A prompt chunk (two rows of one sequence).
        assert!(StepInputs::decode(&[rows(&[1, 2], 0, &table)], 4, 4).is_none());
        // More sequences than rows.
        let one = rows(&[1], 0, &table);
        assert!(StepInputs::decode(&[one, one, one], 2, 4).is_none());
        // A table wider than the graph's.
        assert!(StepInputs::decode(&[rows(&[1], 20, &table)], 1, 1).is_none());
        assert!(StepInputs::decode(&[rows(&[1], 20, &table)], 1, 2).is_some());
    }
}
