//! The question set of `bench quality` (`data/quality-questions.jsonl`, written for this
//! project; docs/quality.md states its provenance and split) and how an answer is scored:
//! its first sentence must contain a reference answer and no competing candidate, both
//! compared as normalised word sequences (lower case, punctuation and articles dropped,
//! number words as digits).

use serde::{Deserialize, Serialize};

const QUESTIONS: &str = include_str!("../../data/quality-questions.jsonl");

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Split {
    /// Questions router training may use.
    Train,
    /// Questions only the evaluation sees.
    Heldout,
}

#[derive(Debug, Clone, Deserialize)]
pub struct Question {
    pub id: String,
    /// Questions of a group compete: another question's answer is a wrong answer here.
    pub group: String,
    pub split: Split,
    pub question: String,
    /// The reference answer and its aliases.
    pub answers: Vec<String>,
    /// Wrong answers to look for; the group's other answers when absent.
    #[serde(default)]
    pub competitors: Option<Vec<String>>,
}

/// A question with its answers and competitors normalised.
#[derive(Debug, Clone)]
pub struct Scorable {
    pub question: Question,
    answers: Vec<Vec<String>>,
    competitors: Vec<Vec<String>>,
}

/// Every shipped question, in file order.
pub fn questions() -> Result<Vec<Question>, String> {
    QUESTIONS
        .lines()
        .enumerate()
        .filter(|(_, line)| !line.trim().is_empty())
        .map(|(i, line)| {
            serde_json::from_str(line)
                .map_err(|e| format!("data/quality-questions.jsonl line {}: {e}", i + 1))
        })
        .collect()
}

/// Normalises each question's answers and competitors; a competitor equal to one of the
/// question's own answers, or found in the question itself (an answer may restate it), is
/// dropped.
pub fn scorable(questions: &[Question]) -> Vec<Scorable> {
    questions
        .iter()
        .map(|q| {
            let answers: Vec<Vec<String>> = q.answers.iter().map(|a| normalise(a)).collect();
            let asked = normalise(&q.question);
            let candidates: Vec<&String> = match &q.competitors {
                Some(c) => c.iter().collect(),
                None => questions
                    .iter()
                    .filter(|o| o.group == q.group && o.id != q.id)
                    .flat_map(|o| &o.answers)
                    .collect(),
            };
            let mut competitors: Vec<Vec<String>> = candidates
                .into_iter()
                .map(|c| normalise(c))
                .filter(|c| !c.is_empty() && !answers.contains(c) && !contains(&asked, c))
                .collect();
            competitors.sort();
            competitors.dedup();
            Scorable {
                question: q.clone(),
                answers,
                competitors,
            }
        })
        .collect()
}

impl Scorable {
    /// Whether `answer`'s first sentence names a reference answer and no competitor.
    pub fn is_correct(&self, answer: &str) -> bool {
        let words = normalise(first_sentence(answer));
        self.answers.iter().any(|a| contains(&words, a))
            && !self.competitors.iter().any(|c| contains(&words, c))
    }
}

/// The text up to the first sentence end (`.`, `!`, `?` not between digits, or a line
/// break), leading blank lines skipped.
pub fn first_sentence(text: &str) -> &str {
    let text = text.trim_start();
    let bytes = text.as_bytes();
    for (i, &b) in bytes.iter().enumerate() {
        let between_digits = |i: usize| {
            i > 0
                && bytes[i - 1].is_ascii_digit()
                && bytes.get(i + 1).is_some_and(|c| c.is_ascii_digit())
        };
        match b {
            b'\n' | b'!' | b'?' => return &text[..i],
            b'.' if !between_digits(i) => return &text[..i],
            _ => {}
        }
    }
    text
}

/// Whether `needle` occurs as consecutive words of `words`.
fn contains(words: &[String], needle: &[String]) -> bool {
    !needle.is_empty() && words.windows(needle.len()).any(|w| w == needle)
}

const ARTICLES: [&str; 3] = ["a", "an", "the"];
const UNITS: [&str; 20] = [
    "zero",
    "one",
    "two",
    "three",
    "four",
    "five",
    "six",
    "seven",
    "eight",
    "nine",
    "ten",
    "eleven",
    "twelve",
    "thirteen",
    "fourteen",
    "fifteen",
    "sixteen",
    "seventeen",
    "eighteen",
    "nineteen",
];
const TENS: [&str; 8] = [
    "twenty", "thirty", "forty", "fifty", "sixty", "seventy", "eighty", "ninety",
];

/// The value of one number word below a hundred.
fn small_number(word: &str) -> Option<u64> {
    if let Some(i) = UNITS.iter().position(|&u| u == word) {
        return Some(i as u64);
    }
    TENS.iter()
        .position(|&t| t == word)
        .map(|i| 20 + 10 * i as u64)
}

/// Lower-case words without punctuation or articles; runs of number words ("three hundred
/// sixty-five") become one number in digits.
pub fn normalise(text: &str) -> Vec<String> {
    let lowered = text.to_lowercase();
    let raw: Vec<&str> = lowered
        .split(|c: char| !c.is_alphanumeric())
        .filter(|w| !w.is_empty() && !ARTICLES.contains(w))
        .collect();
    let mut words = Vec::with_capacity(raw.len());
    let mut i = 0;
    while i < raw.len() {
        let (mut total, mut current, mut used) = (0u64, 0u64, 0usize);
        while let Some(&w) = raw.get(i + used) {
            if let Some(n) = small_number(w) {
                // "twenty five" and "hundred sixty" add; "five twenty" or "ten five" are two
                // numbers.
                let below_hundred = current % 100;
                let fits = match n {
                    10.. => below_hundred == 0,
                    _ => below_hundred == 0 || (below_hundred >= 20 && below_hundred % 10 == 0),
                };
                if used > 0 && !fits {
                    break;
                }
                current += n;
            } else if w == "hundred" && used > 0 && current > 0 {
                current *= 100;
            } else if w == "thousand" && used > 0 && (current > 0 || total > 0) {
                total += current * 1000;
                current = 0;
            } else {
                break;
            }
            used += 1;
        }
        if used == 0 {
            words.push(raw[i].to_string());
            i += 1;
        } else {
            words.push((total + current).to_string());
            i += used;
        }
    }
    words
}

#[cfg(test)]
mod tests {
    use super::*;

    fn words(text: &str) -> Vec<String> {
        normalise(text)
    }

    #[test]
    fn normalising_drops_case_punctuation_and_articles_and_spells_numbers_in_digits() {
        assert_eq!(words("The capital is PARIS!"), ["capital", "is", "paris"]);
        assert_eq!(
            words("A spider has eight legs."),
            ["spider", "has", "8", "legs"]
        );
        assert_eq!(words("twenty-four hours"), ["24", "hours"]);
        assert_eq!(words("three hundred sixty-five days"), ["365", "days"]);
        assert_eq!(words("one two"), ["1", "2"]);
        assert_eq!(words("ten five"), ["10", "5"]);
        assert_eq!(words("twelve 12"), ["12", "12"]);
        assert_eq!(words("two thousand and five"), ["2000", "and", "5"]);
    }

    #[test]
    fn the_first_sentence_ends_at_a_stop_but_not_inside_a_number() {
        assert_eq!(first_sentence("\n Paris. It is big."), "Paris");
        assert_eq!(first_sentence("It is 3.5 metres! Yes"), "It is 3.5 metres");
        assert_eq!(first_sentence("Blue\nGreen"), "Blue");
        assert_eq!(first_sentence("no stop at all"), "no stop at all");
    }

    fn scored(group: &[(&str, &[&str])], competitors: Option<&[&str]>) -> Vec<Scorable> {
        let questions: Vec<Question> = group
            .iter()
            .enumerate()
            .map(|(i, (q, a))| Question {
                id: format!("g-{i}"),
                group: "g".into(),
                split: Split::Heldout,
                question: q.to_string(),
                answers: a.iter().map(|s| s.to_string()).collect(),
                competitors: competitors.map(|c| c.iter().map(|s| s.to_string()).collect()),
            })
            .collect();
        scorable(&questions)
    }

    #[test]
    fn an_answer_is_correct_with_a_reference_or_alias_and_no_competitor() {
        let set = scored(
            &[
                ("What is the capital of France?", &["Paris"]),
                ("What is the capital of Ukraine?", &["Kyiv", "Kiev"]),
                ("What is the capital of Italy?", &["Rome"]),
            ],
            None,
        );
        assert!(set[0].is_correct("The capital of France is Paris."));
        assert!(set[1].is_correct("It is Kiev, on the Dnieper."));
        assert!(!set[0].is_correct("Paris or Rome, I think."));
        assert!(!set[0].is_correct("France is a country. Its capital is Paris."));
        assert!(!set[2].is_correct("The capital of Italy is Milan."));
    }

    #[test]
    fn a_competitor_the_question_names_does_not_count_against_the_answer() {
        let set = scored(
            &[
                ("What is the opposite of \"hot\"?", &["cold"]),
                ("What is the opposite of \"cold\"?", &["hot"]),
                ("What is the opposite of \"big\"?", &["small"]),
            ],
            None,
        );
        assert!(set[0].is_correct("The opposite of hot is cold."));
        assert!(!set[0].is_correct("It is small, or cold."));
        let sums = scored(&[("What is 3 plus 4?", &["7"])], Some(&["6", "8", "3"]));
        assert!(sums[0].is_correct("3 plus 4 is seven."));
        assert!(!sums[0].is_correct("It is 8."));
    }

    #[test]
    fn the_shipped_set_has_300_questions_half_held_out_with_unique_ids() {
        let questions = questions().unwrap();
        assert!(questions.len() >= 300, "{}", questions.len());
        let held_out = questions
            .iter()
            .filter(|q| q.split == Split::Heldout)
            .count();
        assert!(held_out >= 150, "{held_out}");
        let mut ids: Vec<&str> = questions.iter().map(|q| q.id.as_str()).collect();
        ids.sort();
        ids.dedup();
        assert_eq!(ids.len(), questions.len());
        for q in scorable(&questions) {
            assert!(
                !q.answers.is_empty() && q.answers.iter().all(|a| !a.is_empty()),
                "{q:?}"
            );
            let reference = q.question.answers[0].clone();
            assert!(q.is_correct(&reference), "{}: {reference}", q.question.id);
        }
    }
}
