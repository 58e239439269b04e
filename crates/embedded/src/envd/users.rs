//! Users and groups as the sandbox sees them (its own `/etc/passwd`).

use std::path::PathBuf;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct User {
    pub name: String,
    pub uid: u32,
    pub gid: u32,
    pub home: PathBuf,
}

/// Look a user up by name in `/etc/passwd`. `root` always exists, even in a
/// rootfs without a passwd file.
pub fn lookup(name: &str) -> Option<User> {
    let text = std::fs::read_to_string("/etc/passwd").unwrap_or_default();
    let found = text.lines().find_map(|line| {
        let mut f = line.split(':');
        let n = f.next()?;
        if n != name {
            return None;
        }
        let _pw = f.next()?;
        let uid = f.next()?.parse().ok()?;
        let gid = f.next()?.parse().ok()?;
        let _gecos = f.next()?;
        let home = f.next()?;
        Some(User {
            name: n.to_string(),
            uid,
            gid,
            home: PathBuf::from(home),
        })
    });
    found.or_else(|| {
        (name == "root").then(|| User {
            name: "root".into(),
            uid: 0,
            gid: 0,
            home: PathBuf::from("/root"),
        })
    })
}

/// Name of a uid (for `EntryInfo.owner`), or the number as text.
pub fn user_name(uid: u32, passwd: &str) -> String {
    name_of(uid, passwd).unwrap_or_else(|| uid.to_string())
}

fn name_of(id: u32, table: &str) -> Option<String> {
    table.lines().find_map(|line| {
        let mut f = line.split(':');
        let n = f.next()?;
        let _ = f.next()?;
        let v: u32 = f.next()?.parse().ok()?;
        (v == id).then(|| n.to_string())
    })
}

/// Cached `/etc/passwd` and `/etc/group` for one request.
pub struct Names {
    passwd: String,
    group: String,
}

impl Names {
    pub fn load() -> Self {
        Self {
            passwd: std::fs::read_to_string("/etc/passwd").unwrap_or_default(),
            group: std::fs::read_to_string("/etc/group").unwrap_or_default(),
        }
    }

    pub fn user(&self, uid: u32) -> String {
        user_name(uid, &self.passwd)
    }

    pub fn group(&self, gid: u32) -> String {
        name_of(gid, &self.group).unwrap_or_else(|| gid.to_string())
    }
}
