//! The byte layout the integer kernels share for weight columns and activation rows. A row's
//! blocks of 32 are cut into groups of 16, 8, 4 or 2 blocks; inside a group, 64-byte vector
//! `t` holds in each of its 16 four-byte lanes four consecutive elements of one block, so
//! lane `l` always belongs to block `l / (16 / blocks)`. A dot-product instruction then sums
//! a whole group's products per lane in exact integers, and a single float multiply-add per
//! group applies every block's scale (one per lane) instead of one per block.

/// Elements per quantization block (ggml's Q8_0 / Q4_0 / Q4_1 and our activations).
pub const BLOCK: usize = 32;

/// Four-byte lanes of a 64-byte vector.
const LANES: usize = 16;

/// Consecutive blocks that share vectors.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Group {
    /// Index among the row's groups.
    pub index: usize,
    pub first_block: usize,
    /// 16, 8, 4 or 2.
    pub blocks: usize,
}

impl Group {
    /// Lanes of each vector that hold one block's products.
    pub fn lanes_per_block(self) -> usize {
        LANES >> self.blocks.trailing_zeros()
    }

    /// 64-byte vectors the group spans (32 bytes per block).
    pub fn vectors(self) -> usize {
        self.blocks / 2
    }

    /// Where element `element` of the group's block `block` sits among its `32 · blocks`
    /// bytes: vector `chunk / lanes_per_block`, lane `block · lanes_per_block + chunk %
    /// lanes_per_block`, for the element's four-byte chunk `chunk`.
    pub fn position(self, block: usize, element: usize) -> usize {
        // Shifts and masks: `lanes` is a power of two (a division here dominated quantizing
        // the activations).
        let lanes = self.lanes_per_block();
        let chunk = element / 4;
        let (vector, lane) = (chunk >> lanes.trailing_zeros(), chunk & (lanes - 1));
        vector * 64 + (block * lanes + lane) * 4 + element % 4
    }

    /// Where byte `position` of the group's unpacked Q4 nibbles sits among its `16 · blocks`
    /// packed bytes, and whether in the high nibble. Vectors pair up so that one 64-byte load
    /// unpacks into two (low nibbles → vector `2p`, high → `2p + 1`); a two-block group's one
    /// vector comes from 32 bytes (low nibbles → its first 32 bytes, high → its last 32).
    pub fn nibble_slot(self, position: usize) -> (usize, bool) {
        if self.blocks == 2 {
            (position % 32, position >= 32)
        } else {
            let (pair, within) = (position / 128, position % 128);
            (pair * 64 + within % 64, within >= 64)
        }
    }
}

/// Blocks a row stores: an odd count gets one zero block, so every group is whole.
pub fn stored_blocks(blocks: usize) -> usize {
    blocks.next_multiple_of(2)
}

/// A row of `blocks` blocks cut greedily into groups of 16, 8, 4 and 2.
pub fn groups(blocks: usize) -> Vec<Group> {
    let stored = stored_blocks(blocks);
    let mut groups = Vec::new();
    let mut first_block = 0;
    while first_block < stored {
        let left = stored - first_block;
        let blocks = [16, 8, 4, 2]
            .into_iter()
            .find(|&size| size <= left)
            .expect("an even count of blocks is left");
        groups.push(Group {
            index: groups.len(),
            first_block,
            blocks,
        });
        first_block += blocks;
    }
    groups
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn groups_cover_the_row_with_whole_groups() {
        let sizes = |blocks| groups(blocks).iter().map(|g| g.blocks).collect::<Vec<_>>();
        assert_eq!(sizes(18), [16, 2]);
        assert_eq!(sizes(48), [16, 16, 16]);
        assert_eq!(sizes(3), [4]);
        assert_eq!(sizes(30), [16, 8, 4, 2]);
        let g = groups(30);
        assert_eq!((g[3].index, g[3].first_block), (3, 28));
    }

    #[test]
    fn positions_are_a_permutation_with_one_block_per_lane() {
        for blocks in [2, 4, 8, 16] {
            let group = Group {
                index: 0,
                first_block: 0,
                blocks,
            };
            let mut seen = vec![false; 32 * blocks];
            for block in 0..blocks {
                for element in 0..BLOCK {
                    let p = group.position(block, element);
                    assert!(!seen[p], "{blocks} blocks: position {p} twice");
                    seen[p] = true;
                    assert_eq!((p % 64) / 4 / group.lanes_per_block(), block);
                }
            }
            let mut slots = vec![[false; 2]; 16 * blocks];
            for p in 0..32 * blocks {
                let (byte, high) = group.nibble_slot(p);
                assert!(
                    !slots[byte][high as usize],
                    "{blocks} blocks: slot of {p} twice"
                );
                slots[byte][high as usize] = true;
            }
        }
    }
}
