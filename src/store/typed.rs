//! Typed table access shared by the record modules: one query function
//! serves both transaction kinds (`ReadOps`), writes take the write
//! transaction. Values are JSON through `codec`.

use redb::{ReadTransaction, ReadableTable, TableDefinition, WriteTransaction};
use serde::Serialize;
use serde::de::DeserializeOwned;

use super::{StoreError, codec};

/// A `&str → JSON` table.
pub type Records = TableDefinition<'static, &'static str, &'static [u8]>;
/// A `&str → &str` table (an index to a key).
pub type Links = TableDefinition<'static, &'static str, &'static str>;
/// A `owner \0 item → ()` index table.
pub type Index = TableDefinition<'static, &'static str, ()>;

/// Reads that both transaction kinds answer.
pub trait ReadOps {
    /// The record under `key`, decoded.
    fn record<T: DeserializeOwned>(
        &self,
        table: Records,
        key: &str,
    ) -> Result<Option<T>, StoreError>;
    /// Whether `key` is present.
    fn has(&self, table: Records, key: &str) -> Result<bool, StoreError>;
    /// Every record of the table, in key order.
    fn records<T: DeserializeOwned>(&self, table: Records) -> Result<Vec<T>, StoreError>;
    /// The value of a link table under `key`.
    fn link(&self, table: Links, key: &str) -> Result<Option<String>, StoreError>;
    /// The keys of an index table in `[from, to)`.
    fn index_keys(&self, table: Index, from: &str, to: &str) -> Result<Vec<String>, StoreError>;
}

macro_rules! read_ops {
    ($t:ty) => {
        impl ReadOps for $t {
            fn record<T: DeserializeOwned>(
                &self,
                table: Records,
                key: &str,
            ) -> Result<Option<T>, StoreError> {
                let t = self.open_table(table)?;
                match t.get(key)? {
                    Some(v) => Ok(Some(codec::decode(v.value())?)),
                    None => Ok(None),
                }
            }

            fn has(&self, table: Records, key: &str) -> Result<bool, StoreError> {
                Ok(self.open_table(table)?.get(key)?.is_some())
            }

            fn records<T: DeserializeOwned>(&self, table: Records) -> Result<Vec<T>, StoreError> {
                let t = self.open_table(table)?;
                let mut out = vec![];
                for r in t.iter()? {
                    let (_, v) = r?;
                    out.push(codec::decode(v.value())?);
                }
                Ok(out)
            }

            fn link(&self, table: Links, key: &str) -> Result<Option<String>, StoreError> {
                Ok(self
                    .open_table(table)?
                    .get(key)?
                    .map(|v| v.value().to_string()))
            }

            fn index_keys(
                &self,
                table: Index,
                from: &str,
                to: &str,
            ) -> Result<Vec<String>, StoreError> {
                let t = self.open_table(table)?;
                let mut keys = vec![];
                for r in t.range(from..to)? {
                    keys.push(r?.0.value().to_string());
                }
                Ok(keys)
            }
        }
    };
}
read_ops!(ReadTransaction);
read_ops!(WriteTransaction);

/// Insert (or replace) a record.
pub fn put<T: Serialize>(
    txn: &WriteTransaction,
    table: Records,
    key: &str,
    value: &T,
) -> Result<(), StoreError> {
    let b = codec::encode(value)?;
    txn.open_table(table)?.insert(key, b.as_slice())?;
    Ok(())
}

/// Remove a record (absent is fine): whether it was there.
pub fn remove(txn: &WriteTransaction, table: Records, key: &str) -> Result<bool, StoreError> {
    Ok(txn.open_table(table)?.remove(key)?.is_some())
}

/// Set a link.
pub fn put_link(
    txn: &WriteTransaction,
    table: Links,
    key: &str,
    value: &str,
) -> Result<(), StoreError> {
    txn.open_table(table)?.insert(key, value)?;
    Ok(())
}

/// Remove a link (absent is fine).
pub fn remove_link(txn: &WriteTransaction, table: Links, key: &str) -> Result<(), StoreError> {
    txn.open_table(table)?.remove(key)?;
    Ok(())
}

/// Add an index entry.
pub fn put_index(txn: &WriteTransaction, table: Index, key: &str) -> Result<(), StoreError> {
    txn.open_table(table)?.insert(key, ())?;
    Ok(())
}

/// Remove an index entry (absent is fine).
pub fn remove_index(txn: &WriteTransaction, table: Index, key: &str) -> Result<(), StoreError> {
    txn.open_table(table)?.remove(key)?;
    Ok(())
}
