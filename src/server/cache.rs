//! The prefix cache: saved sequence states keyed by the token ids they hold, bounded by
//! bytes, least recently used evicted first. A request resumes from the longest saved state
//! whose ids are a proper prefix of its prompt (at least one prompt token must still run, to
//! produce the first logits). States saved under a `prompt_cache_key` are the caller's: when
//! a request with that key needs room, other keys' (and untagged) states go first.

struct Entry<S> {
    ids: Vec<u32>,
    key: Option<String>,
    state: S,
    bytes: usize,
    last_used: u64,
}

pub struct PrefixCache<S> {
    entries: Vec<Entry<S>>,
    capacity: usize,
    used: usize,
    clock: u64,
}

impl<S> PrefixCache<S> {
    /// A cache holding at most `capacity` bytes of states (0 disables it).
    pub fn new(capacity: usize) -> Self {
        PrefixCache {
            entries: Vec::new(),
            capacity,
            used: 0,
            clock: 0,
        }
    }

    pub fn bytes(&self) -> usize {
        self.used
    }

    /// The most bytes it holds (a state larger than this is not kept).
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// The longest saved state whose ids are a proper prefix of `prompt`, and its length.
    pub fn lookup(&mut self, prompt: &[u32]) -> Option<(usize, &S)> {
        self.clock += 1;
        let clock = self.clock;
        let best = self
            .entries
            .iter_mut()
            .filter(|e| e.ids.len() < prompt.len() && prompt.starts_with(&e.ids))
            .max_by_key(|e| e.ids.len())?;
        best.last_used = clock;
        Some((best.ids.len(), &best.state))
    }

    /// Saves `state` (holding `ids`, costing `bytes`, tagged with `key`), replacing a state
    /// with the same ids and evicting until it fits: the least recently used state of another
    /// key first, then of the same key. A state larger than the whole cache is not kept.
    pub fn insert(&mut self, ids: Vec<u32>, state: S, bytes: usize, key: Option<&str>) {
        if ids.is_empty() || bytes > self.capacity {
            return;
        }
        self.clock += 1;
        if let Some(i) = self.entries.iter().position(|e| e.ids == ids) {
            let old = self.entries.swap_remove(i);
            self.used -= old.bytes;
        }
        while self.used + bytes > self.capacity {
            let Some((i, _)) = self
                .entries
                .iter()
                .enumerate()
                .min_by_key(|(_, e)| (key.is_some() && e.key.as_deref() == key, e.last_used))
            else {
                break;
            };
            let old = self.entries.swap_remove(i);
            self.used -= old.bytes;
        }
        self.used += bytes;
        self.entries.push(Entry {
            ids,
            key: key.map(str::to_string),
            state,
            bytes,
            last_used: self.clock,
        });
    }
}

impl<S> PrefixCache<S> {
    /// Drops the least recently used state, sparing those whose ids are a prefix of `spare`
    /// while others are left (the request making room would resume from them). `false`:
    /// the cache was empty.
    pub fn evict_lru(&mut self, spare: &[u32]) -> bool {
        let Some((i, _)) = self
            .entries
            .iter()
            .enumerate()
            .min_by_key(|(_, e)| (spare.starts_with(&e.ids), e.last_used))
        else {
            return false;
        };
        let old = self.entries.swap_remove(i);
        self.used -= old.bytes;
        true
    }

    /// Limits the cache to `capacity` bytes, evicting least recently used states to fit.
    pub fn set_capacity(&mut self, capacity: usize) {
        self.capacity = capacity;
        while self.used > capacity && self.evict_lru(&[]) {}
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_cache_key_keeps_its_own_states_in_preference() {
        let mut c = super::PrefixCache::new(20);
        c.insert(vec![1], "mine", 10, Some("alice"));
        c.insert(vec![2], "other", 10, Some("bob"));
        // Room for a new "alice" state: bob's goes although alice's is older.
        c.insert(vec![3], "mine too", 10, Some("alice"));
        assert_eq!(c.lookup(&[1, 0]), Some((1, &"mine")));
        assert!(c.lookup(&[2, 0]).is_none());
        // Without a key, plain LRU: the least recently used ([3]) goes.
        c.insert(vec![4], "anon", 10, None);
        assert!(c.lookup(&[3, 0]).is_none());
        assert_eq!(c.lookup(&[1, 0]), Some((1, &"mine")));
    }

    use super::*;

    #[test]
    fn longest_proper_prefix_wins() {
        let mut c = PrefixCache::new(100);
        c.insert(vec![1, 2], "a", 10, None);
        c.insert(vec![1, 2, 3], "b", 10, None);
        c.insert(vec![1, 9], "c", 10, None);
        assert_eq!(c.lookup(&[1, 2, 3, 4]), Some((3, &"b")));
        // the whole prompt is never a hit: one token must still run
        assert_eq!(c.lookup(&[1, 2, 3]), Some((2, &"a")));
        assert_eq!(c.lookup(&[5, 1, 2]), None);
    }

    #[test]
    fn lru_eviction_by_bytes() {
        let mut c = PrefixCache::new(30);
        c.insert(vec![1], "a", 10, None);
        c.insert(vec![2], "b", 10, None);
        c.insert(vec![3], "c", 10, None);
        assert!(c.lookup(&[1, 0]).is_some()); // touch a
        c.insert(vec![4], "d", 10, None); // evicts b, the least recently used
        assert!(c.lookup(&[2, 0]).is_none());
        assert!(c.lookup(&[1, 0]).is_some());
        assert_eq!((c.len(), c.bytes()), (3, 30));
        c.insert(vec![5], "big", 31, None); // larger than the cache: not kept
        assert_eq!((c.len(), c.bytes()), (3, 30));
        c.insert(vec![1], "a2", 5, None); // same ids: replaced
        assert_eq!((c.len(), c.bytes()), (3, 25));
        assert_eq!(c.lookup(&[1, 0]), Some((1, &"a2")));
        let mut off = PrefixCache::new(0);
        off.insert(vec![1], "a", 1, None);
        assert!(off.is_empty());
    }

    #[test]
    fn eviction_spares_the_prefixes_of_the_prompt_making_room() {
        let mut c = PrefixCache::new(100);
        c.insert(vec![1, 2], "mine", 10, None);
        c.insert(vec![7], "other", 10, None);
        c.insert(vec![8], "newest", 10, None);
        // [1, 2] is the least recently used but a prefix of the prompt: [7] goes first.
        assert!(c.evict_lru(&[1, 2, 3]));
        assert!(c.lookup(&[7, 0]).is_none());
        assert_eq!(c.lookup(&[1, 2, 3]), Some((2, &"mine")));
        // Shrinking evicts least recently used first, down to the new limit.
        c.set_capacity(10);
        assert_eq!((c.len(), c.bytes()), (1, 10));
        assert_eq!(c.lookup(&[1, 2, 3]), Some((2, &"mine")));
        c.set_capacity(0);
        assert!(c.is_empty() && c.bytes() == 0);
        assert!(!c.evict_lru(&[]));
        c.insert(vec![3], "no room", 1, None);
        assert!(c.is_empty());
    }
}
